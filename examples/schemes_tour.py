"""A tour of every registered scheme: a small decoder per scheme, proven batch-correct.

python examples/schemes_tour.py      (the same as `relpos tour`)
"""

from relpos.tour import main

if __name__ == "__main__":
    raise SystemExit(main())
