"""Slow, obviously-correct references: loops over (b, h, i, j), straight from the papers.

Nothing here is vectorised or clever, and nothing reuses relpos's functional core: positions are
Python ints read per token, every term is written as the paper writes it. Built from torch scalar
ops so that autograd runs through the oracle too, and gradients can be compared.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

import relpos

# ----------------------------------------------------------------------------- per-scheme terms


def clip(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, x))


def t5_bucket(distance: int, *, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """T5's bucketing (Raffel et al. 2020), one distance at a time, with Python floats."""
    n = -distance  # > 0: key before the query
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        if n < 0:
            bucket += num_buckets
        n = abs(n)
    else:
        n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    far = exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact))
    return bucket + min(far, num_buckets - 1)


def alibi_slope(head: int, num_heads: int) -> float:
    """Press et al.: 2^(-8/n)^(h+1) for n a power of two; otherwise the nearest lower power of two's
    slopes, then every other slope of twice that power."""

    def geometric(n: int) -> list[float]:
        return [2 ** (-8 * (i + 1) / n) for i in range(n)]

    p = 1
    while p * 2 <= num_heads:
        p *= 2
    slopes = geometric(p) + geometric(2 * p)[0::2][: num_heads - p]
    return slopes[head]


def deberta_row(config: relpos.DebertaConfig, pi: int, pj: int) -> int:
    """DeBERTa's table row of a pair (He et al., 2021, §3.1, with v2's log buckets): ``p_i - p_j``
    exact up to ``mid`` in magnitude, log-spaced beyond, shifted by the span and clipped."""
    x, buckets, m = pi - pj, config.position_buckets, config.max_relative_positions
    span = buckets if buckets > 0 else m
    mid = buckets // 2
    if buckets > 0 and abs(x) > mid:
        far = mid + math.ceil(math.log(abs(x) / mid) / math.log((m - 1) / mid) * (mid - 1))
        x = far if x > 0 else -far
    return clip(x + span, 0, 2 * span - 1)


def deberta_position_state(scheme: relpos.DeBERTa, term: str, h: int, row: int) -> Tensor:
    """Head ``h``'s projection of row ``row`` of the (layer-normalised) relative table: ``K_r``
    for ``"c2p"``, ``Q_r`` for ``"p2c"``."""
    d = scheme.head_dim
    p = scheme.rel_embeddings[row]
    if scheme.layer_norm is not None:
        mean = p.mean()
        var = ((p - mean) ** 2).mean()
        ln = scheme.layer_norm
        p = (p - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias
    proj = scheme.projections[scheme.projection_names[term]]
    return proj.weight[h * d : (h + 1) * d] @ p + proj.bias[h * d : (h + 1) * d]


def content_scale(scheme: relpos.Scheme, d: int) -> float:
    """The factor of ``q·k`` in the logits: ``1/√d``, or DeBERTa's ``1/√(s·d)`` with ``s = 1 +``
    its number of position terms."""
    if isinstance(scheme, relpos.DeBERTa):
        return 1.0 / math.sqrt((1 + len(scheme.config.pos_att_type)) * d)
    return 1.0 / math.sqrt(d)


def logit_term(
    scheme: relpos.Scheme,
    q: Tensor,
    h: int,
    pi: int,
    pj: int,
    k: Tensor | None = None,
    seen: list[tuple[int, Tensor]] | None = None,
) -> Tensor | float:
    """The scheme's additive term of the scaled logit of query ``q`` (position pi) and key ``k``
    (position pj); ``seen``: ``(position, key)`` of every key the query may attend to (CoPE)."""
    d = q.shape[-1]
    if isinstance(scheme, relpos.CoPE):  # Golovneva et al., 2024, §3
        # p_ij = Σ_{t=j}^{i} σ(q_i·k_t/√d): the keys the query sees from key j's position up to
        # its own (causal: none after it), clamped to npos_max - 1.
        gates = [torch.sigmoid(torch.dot(q, kt) / math.sqrt(d)) for pt, kt in seen if pt >= pj]
        p = torch.clamp(sum(gates), max=scheme.config.npos_max - 1)
        table = scheme.pos_emb[h] if scheme.config.per_head else scheme.pos_emb
        lo, hi = math.floor(p.item()), math.ceil(p.item())
        w = p - lo  # e[p] interpolated between its integer rows
        return (1 - w) * torch.dot(q, table[lo]) + w * torch.dot(q, table[hi])
    if isinstance(scheme, relpos.DeBERTa):  # He et al., 2021, eq. 4: c2p and p2c
        row = deberta_row(scheme.config, pi, pj)
        term = 0.0
        if "c2p" in scheme.config.pos_att_type:
            term = term + torch.dot(q, deberta_position_state(scheme, "c2p", h, row))
        if "p2c" in scheme.config.pos_att_type:
            term = term + torch.dot(k, deberta_position_state(scheme, "p2c", h, row))
        return term * content_scale(scheme, d)
    heads = getattr(scheme.config, "heads", None)
    if heads is not None and h not in heads:  # per-head control: this head gets no bias
        return 0.0
    if isinstance(scheme, relpos.Fire):  # Li et al., 2024, §3: f(ψ(i - j) / ψ(max(L, i)))
        c = scheme.c.abs()
        threshold = (scheme.threshold_scale * scheme.config.init_threshold).abs()
        reach = threshold if threshold > pi else torch.tensor(float(pi), dtype=c.dtype)

        def psi(x):
            return torch.log(c * x + 1)

        x = psi(max(pi - pj, 0)) / (psi(reach) + 1e-6)
        first, last = scheme.mlp[0], scheme.mlp[2]
        hidden = [
            torch.relu(first.weight[u, 0] * x + first.bias[u]) for u in range(len(first.bias))
        ]
        return sum(last.weight[h, u] * a for u, a in enumerate(hidden)) + last.bias[h]
    if isinstance(scheme, relpos.Sandwich):  # Chi et al., 2023, §5: p_i·p_j, shifted, per head
        c = scheme.config
        inner = sum(
            math.cos((pj - pi) / c.base ** (2 * k / c.dim)) for k in range(1, c.dim // 2 + 1)
        )
        return (inner - c.dim / 2) / (8 * (h + 1) / scheme.num_heads)
    if isinstance(scheme, relpos.TransformerXL):  # Dai et al., 2019, §3.3: terms (b), (c), (d)
        m = scheme.config.max_distance
        delta = pi - clip(pj, pi - m, pi if scheme.causal else pi + m)  # clipped p_i - p_j
        omega = [10000 ** (-2 * t / scheme.d_model) for t in range(scheme.d_model // 2)]
        r = torch.tensor(
            [math.sin(delta * w) for w in omega] + [math.cos(delta * w) for w in omega],
            dtype=q.dtype,
        )
        w_r = scheme.position_proj.weight[h * d : (h + 1) * d]  # head h's rows of W_R
        pos_key = w_r @ r
        u, v = scheme.content_bias[h], scheme.position_bias[h]
        return (torch.dot(q, pos_key) + torch.dot(u, k) + torch.dot(v, pos_key)) / math.sqrt(d)
    if isinstance(scheme, relpos.ShawRelative) and scheme.key_table is not None:
        k = scheme.config.max_distance
        table = scheme.key_table[h] if scheme.config.per_head else scheme.key_table
        return torch.dot(q, table[clip(pj - pi, -k, k) + k]) / math.sqrt(d)
    if isinstance(scheme, relpos.MusicRelative):
        m = scheme.config.max_distance
        row = clip(pj - pi, -m, 0 if scheme.causal else m) + m
        return torch.dot(q, scheme.table[h, row]) / math.sqrt(d)
    if isinstance(scheme, relpos.T5Bias):
        c = scheme.config
        b = t5_bucket(
            pj - pi,
            bidirectional=not scheme.causal,
            num_buckets=c.num_buckets,
            max_distance=c.max_distance,
        )
        return scheme.table[b, h]
    if isinstance(scheme, relpos.Kerple):  # Chi et al., 2022, §4, with the clamped parameters
        r1, r2 = (t[h] for t in scheme.parameters_in_range())
        distance = abs(pj - pi)
        if scheme.config.variant == "log":
            return -r1 * torch.log1p(r2 * distance)
        return -r1 * distance**r2
    if isinstance(scheme, relpos.DynamicPositionBias):  # the MLP on this one distance
        x = float(abs(pj - pi) if scheme.causal else pj - pi)
        if scheme.config.log_distance:
            x = math.copysign(math.log1p(abs(x)), x)
        return scheme.mlp(torch.tensor([[x]], dtype=scheme.mlp[0].weight.dtype))[0, h]
    if isinstance(scheme, relpos.LearnedALiBi):
        slope = scheme.slopes[h].clamp(min=0.0)
        return slope * (pj - pi) if scheme.causal else -slope * abs(pj - pi)
    if isinstance(scheme, relpos.ALiBi):
        given = scheme.config.slopes
        slope = given[h] if given else alibi_slope(h, scheme.num_heads)
        return slope * (pj - pi) if scheme.causal else -slope * abs(pj - pi)
    return 0.0


def forget_sum(
    scheme: relpos.Scheme,
    x: Tensor,
    pos: list[int],
    seg: list[int],
    h: int,
    pi: int,
    pj: int,
    s: int,
) -> Tensor | float:
    """The Forgetting Transformer's ``D_ij = Σ_{l=j+1}^{i} log f_l`` (Lin et al., 2025, eq. 5) for
    head ``h``: over the tokens ``l`` of the row (``x (n, d_model)`` at ``pos``/``seg``) in
    sequence ``s`` at positions ``pj < p_l <= pi``, with ``f_l = σ(w_h·x_l + b_h)``."""
    if not isinstance(scheme, relpos.ForgetGate):
        return 0.0
    w, b = scheme.gate.weight[h], scheme.gate.bias[h]
    total = 0.0
    for t in range(len(pos)):
        if seg[t] == s and pj < pos[t] <= pi:
            total = total + torch.log(torch.sigmoid(torch.dot(w, x[t]) + b))
    return total


def value_vector(scheme: relpos.Scheme, h: int, pi: int, pj: int) -> Tensor | None:
    """Shaw's ``a^V_ij``, added to value j for query i."""
    if isinstance(scheme, relpos.ShawRelative) and scheme.value_table is not None:
        k = scheme.config.max_distance
        table = scheme.value_table[h] if scheme.config.per_head else scheme.value_table
        return table[clip(pj - pi, -k, k) + k]
    return None


def rotate_vector(
    scheme: relpos.Scheme,
    x: Tensor,
    p: int,
    *,
    length: int = 0,
    key: bool = False,
    coords: list[int] | None = None,
) -> Tensor:
    """RoPE: rotate each feature pair m by angle ``p·ω_m`` with an explicit 2×2 rotation.

    ``length``: the length of the token's sequence (dynamic NTK, LongRoPE choose ``ω`` by it).
    xPos scales pair m by ``ζ_m^(p/γ)`` for a query and ``ζ_m^(-p/γ)`` for a key (``key``).
    Learned frequencies are read from the scheme's parameter. ``coords``: with sections, pair m
    turns by ``coords[axis(m)]·ω'_m`` instead (M-RoPE, axial RoPE; :func:`rope_pair`).
    """
    if not isinstance(scheme, relpos.Rotary):
        return x
    c = scheme.config
    r, scaling = scheme.rotary_dim, c.scaling_dict
    out = list(x.unbind(0))
    for m in range(r // 2):
        a, b = (2 * m, 2 * m + 1) if c.interleaved else (m, m + r // 2)
        axis, omega = rope_pair(m, r, c, length=length)
        at = p if coords is None else coords[axis]
        if c.learned_freq:
            omega = scheme.inv_freq[m]
            c_, s_ = torch.cos(at * omega), torch.sin(at * omega)
        else:
            c_, s_ = math.cos(at * omega), math.sin(at * omega)
        scale = 1.0
        if c.xpos_scale_base is not None:  # Sun et al., 2022, §3.2
            zeta = (2 * m / r + 0.4) / 1.4
            scale = zeta ** ((-p if key else p) / c.xpos_scale_base)
        out[a], out[b] = (
            (x[a] * c_ - x[b] * s_) * scale,
            (x[a] * s_ + x[b] * c_) * scale,
        )
    return torch.stack(out) * rope_attention_factor(scaling)


def rope_pair(m: int, r: int, config: relpos.RotaryConfig, *, length: int = 0) -> tuple[int, float]:
    """Axis and frequency of rotary pair ``m``. Section ``s`` (a run of ``S`` pairs) reads axis
    ``s``; M-RoPE keeps the one-axis ladder (Qwen2-VL §2.1), axial RoPE restarts a full ladder
    ``θ^(-2m'/(2S))`` in every section, ``m'`` the pair's index in it (Heo et al., 2024)."""
    sections = config.sections or (r // 2,)
    axis = 0
    while m >= sum(sections[: axis + 1]):
        axis += 1
    start, size = sum(sections[:axis]), sections[axis]
    if config.axial:
        return axis, config.theta ** (-2 * (m - start) / (2 * size))
    return axis, rope_frequency(m, r, config.theta, config.scaling_dict, length=length)


def rope_frequency(m: int, r: int, theta: float, scaling: dict | None, *, length: int = 0) -> float:
    """Frequency of feature pair ``m`` of ``r`` rotated features, from each scaling's paper;
    ``length``: the length of the token's sequence, for the length-dependent types."""
    omega = theta ** (-2 * m / r)
    kind = None if scaling is None else scaling["rope_type"]
    if kind is None or kind == "default":
        return omega
    if kind == "longrope":  # Ding et al., 2024: per-pair factors, long ones past the original
        long = length > scaling["original_max_position_embeddings"]
        return omega / scaling["long_factor" if long else "short_factor"][m]
    factor = scaling["factor"]
    if kind == "dynamic":  # NTK base change sized to the sequence once it outgrows the original
        original = scaling["original_max_position_embeddings"]
        if length <= original:
            return omega
        base = theta * (factor * length / original - factor + 1) ** (r / (r - 2))
        return base ** (-2 * m / r)
    if kind == "linear":  # Chen et al., 2023: positions divided by the factor
        return omega / factor
    if kind == "ntk":  # the base grows so that the slowest pair is interpolated by the factor
        return (theta * factor ** (r / (r - 2))) ** (-2 * m / r)
    length = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        wavelength = 2 * math.pi / omega
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if wavelength < length / hi:
            return omega
        if wavelength > length / lo:
            return omega / factor
        t = (length / wavelength - lo) / (hi - lo)
        return (1 - t) * omega / factor + t * omega

    # YaRN (Peng et al., 2023, §3.2): pair m turns length·ω_m/2π times over the original
    # context; at least beta_fast turns: kept, at most beta_slow: interpolated, linear between,
    # the boundaries taken as whole dims (floor / ceil) unless truncate is off.
    def dim(turns: float) -> float:
        return r * math.log(length / (turns * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim(scaling["beta_fast"]), dim(scaling["beta_slow"])
    if scaling["truncate"]:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, r - 1)
    ramp = min(max((m - lo) / (hi - lo), 0.0), 1.0)
    return ramp * omega / factor + (1 - ramp) * omega


def rope_attention_factor(scaling: dict | None) -> float:
    """YaRN's scale on q and k, ``0.1·ln(factor) + 1``, and LongRoPE's,
    ``√(1 + ln(factor)/ln(L))`` (or the given attention_factor)."""
    kind = None if scaling is None else scaling["rope_type"]
    if kind not in ("yarn", "longrope"):
        return 1.0
    if scaling["attention_factor"] is not None:
        return scaling["attention_factor"]
    if kind == "longrope":
        length = scaling["original_max_position_embeddings"]
        factor = scaling["factor"] or scaling["max_position_embeddings"] / length
        return math.sqrt(1 + math.log(factor) / math.log(length)) if factor > 1 else 1.0
    return 0.1 * math.log(scaling["factor"]) + 1.0 if scaling["factor"] > 1 else 1.0


def embedding(scheme: relpos.Scheme, p: int) -> Tensor | None:
    """Absolute encoding of position p (Vaswani et al. §3.5; learned tables)."""
    d = scheme.d_model
    if isinstance(scheme, relpos.Sinusoidal):
        base = scheme.config.base
        sin = [math.sin(p / base ** (2 * i / d)) for i in range(d // 2)]
        cos = [math.cos(p / base ** (2 * i / d)) for i in range(d // 2)]
        if scheme.config.interleaved:
            values = [v for pair in zip(sin, cos, strict=True) for v in pair]
        else:
            values = sin + cos
        return torch.tensor(values)
    if isinstance(scheme, relpos.LearnedAbsolute):
        return scheme.table[p]
    return None


# ----------------------------------------------------------------------------- attention


def attention(
    scheme: relpos.Scheme,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: list[list[int]],
    q_seg: list[list[int]],
    k_pos: list[list[int]],
    k_seg: list[list[int]],
    *,
    causal: bool,
    q_coords: list[list[list[int]]] | None = None,
    k_coords: list[list[list[int]]] | None = None,
    x: Tensor | None = None,
) -> Tensor:
    """Attention of un-rotated ``q (b, h, i, d)`` over ``k, v (b, h, j, d)``, one pair at a time.

    Query i may see key j when both are real tokens (segment != -1) of the same segment and, if
    causal, ``k_pos <= q_pos``. A query that sees nothing outputs zeros. ``q_coords`` /
    ``k_coords`` ``(b, n, a)``: per-axis coordinates for multi-axis RoPE (both or neither).
    ``x (b, j, d_model)``: the keys' layer inputs, for the forget gates (:func:`forget_sum`).
    """
    n_b, n_h, n_i, D = q.shape
    n_j = k.shape[2]
    rows = []
    for b in range(n_b):
        # Length of each sequence: one more than the largest position of its queries and keys.
        length: dict[int, int] = {}
        for p, s in [*zip(q_pos[b], q_seg[b], strict=True), *zip(k_pos[b], k_seg[b], strict=True)]:
            length[s] = max(length.get(s, 0), p + 1)
        heads = []
        for h in range(n_h):
            outs = []
            for i in range(n_i):
                pi, si = q_pos[b][i], q_seg[b][i]
                keys = [
                    j
                    for j in range(n_j)
                    if si != -1 and k_seg[b][j] == si and (not causal or k_pos[b][j] <= pi)
                ]
                if not keys:
                    outs.append(q.new_zeros(D))
                    continue
                qc = None if q_coords is None else q_coords[b][i]
                qi = rotate_vector(scheme, q[b, h, i], pi, length=length[si], coords=qc)
                rotated = {}
                for j in keys:
                    kc = None if k_coords is None else k_coords[b][j]
                    rotated[j] = rotate_vector(
                        scheme, k[b, h, j], k_pos[b][j], length=length[si], key=True, coords=kc
                    )
                seen = [(k_pos[b][t], rotated[t]) for t in keys]
                logits = []
                for j in keys:
                    kj = rotated[j]
                    logit = torch.dot(qi, kj) * content_scale(scheme, D)
                    logit = logit + logit_term(scheme, qi, h, pi, k_pos[b][j], kj, seen)
                    if x is not None:
                        logit = logit + forget_sum(
                            scheme, x[b], k_pos[b], k_seg[b], h, pi, k_pos[b][j], si
                        )
                    logits.append(logit)
                probs = torch.softmax(torch.stack(logits), dim=0)
                acc = q.new_zeros(D)
                for p, j in zip(probs, keys, strict=True):
                    value = v[b, h, j]
                    extra = value_vector(scheme, h, pi, k_pos[b][j])
                    acc = acc + p * (value if extra is None else value + extra)
                outs.append(acc)
            heads.append(torch.stack(outs))
        rows.append(torch.stack(heads))
    return torch.stack(rows)
