"""The Python examples of docs/keras.md run as written."""

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "keras.md"


def test_keras_doc_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    runnable = [b for b in blocks if "tf.map_fn" not in b]  # the before/after sketch
    assert runnable, "docs/keras.md has no runnable python example"
    for block in runnable:
        exec(compile(block, str(DOC), "exec"), {})
