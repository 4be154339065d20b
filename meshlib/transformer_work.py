"""What one rank computes and keeps for one microbatch of a transformer stage (`meshlib.transformer`'s parts).

Per layer and microbatch, with n = b·s/cp tokens on the rank, t = tp, e bytes per activation element:

- **Matrix products** by size, each `(flops, bytes, count)`: the QKV (or MLA's low-rank) projections, the
  output projection, the MLP (two matrices, or SwiGLU's three with gate and up fused), the routed experts
  (one product per local expert, n·top_k·ep/E tokens each) and shared experts, the head. Backward runs each
  weight's product twice (input gradient, weight gradient: the latter is `weight`, a zero-bubble W).
  The attention core is one batched product per pass over the rank's `b·heads/t` heads: scores and
  probabilities·values written out (Megatron 2022); or (`flash`) one fused kernel, its FLOPs counted
  apart from the plain products (`Compute.attention`, run at the profile's `attention_fraction`), its causal
  mask skipping half the blocks and its backward recomputing the scores (five products for the forward's two).
- **Memory-bound ops** as bytes read and written, after Korthikanti et al. 2022's per-layer walk: two norms
  (read x, write y), bias-dropout-residual (read the branch and the residual, write the sum and a 1-byte
  mask), the MLP activation (GELU with its bias: read and write; SwiGLU: read two, write one), rotary
  embeddings on q and k, and without `flash` the fused scale-mask-softmax over the b·heads/t·s² scores
  (read, write), their dropout (read, write, mask) and the context's transpose. Backward reads what forward
  kept and the incoming gradient and writes the outgoing one (norm: 3e, dropout: 2e + 1, GELU: 3e, SwiGLU:
  5e, softmax: 3e per element) and adds the residual's gradient (3e). Without sequence parallelism the
  norms, dropouts and residuals run on all n tokens on every tensor-parallel rank; with it on n/t.
- **Recompute**: "block" runs the forward again; "selective" the attention core (its products, softmax and
  dropout): nothing under `flash`, which never keeps the scores.
- **Activations kept** per layer (`layer_activation`): Korthikanti's walk in bytes, which for a GPT layer
  with dropout is sbh(34 + 5as/h) on one device, sbh(10 + 24/t + 5as/(ht)) under tensor parallelism,
  sbh(34/t + 5as/(ht)) with sequence parallelism, without the scores' 5as/(ht) under selective recompute,
  and 2sbh (2sbh/t with sequence parallelism) under block recompute. A mixture-of-experts layer keeps, per
  (token, expert) pair, its row in expert order, the expert MLP's activations and its output row (the
  combine's product with the routing weight needs it for the weight's gradient); and per token, the router's
  input in fp32 (routers score in fp32, as DeepSeek-V3's does), its fp32 scores and its top-k selection.
  Unfused norms that compute in fp32 (`ModelShape.norm_fp32`: transformers' RMSNorm upcasts its input) keep
  that fp32 copy instead of the input: 4 - e bytes an element more per norm.
- **Waiting for the weight gradient** (`chunk_weight_residue`): in a zero-bubble schedule a chunk's input
  gradient (I) runs before its weight gradient (W). torch's pipelining runs I with the graph retained
  (`stage_backward_input`) and captures the gradients reaching the weights' ops, so until W the chunk
  keeps its activations and, per layer, the gradient of every weight's output (the products' and the
  norms'), and under sequence parallelism the attention's and the MLP's all-gathered inputs, which I gathers
  again (meshlib keeps them as shards between forward and backward) and W reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from .schedules import even_layers
from .workload import Compute

__all__ = [
    "COMPUTE_FIELDS", "Passes", "accumulation", "chunk_activation", "chunk_weight_residue", "head_activation",
    "layer_split", "stage_params", "stage_passes", "widths",
]  # fmt: skip

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass(frozen=True, slots=True)
class Passes:
    """One microbatch's passes on one rank: forward, backward (both gradients), recompute, and `weight`, the
    weight-gradient part of backward a zero-bubble schedule runs apart."""

    forward: Compute
    backward: Compute
    recompute: Compute
    weight: Compute


def layer_split(shape, pp: int, v: int, zbv: bool = False) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per pipeline rank, per chunk in stage order: `(dense layers, MoE layers)`, the layers spread evenly
    (`meshlib.schedules.even_layers`, what the backend's `balance="layers"` splits). Virtual stage k (of
    pp·v) lives on rank k mod pp (Megatron's interleaving), or (`zbv`) on rank k for k < pp and 2·pp-1-k
    after (ZB-V's V)."""
    dense_left, out = shape.layers - shape.moe_layers, [[] for _ in range(pp)]
    for stage, count in enumerate(even_layers(shape.layers, pp * v)):
        dense = min(count, dense_left)
        dense_left -= dense
        out[2 * pp - 1 - stage if zbv and stage >= pp else stage % pp].append((dense, count - dense))
    return tuple(tuple(row) for row in out)


def _mm(m: float, k: float, n: float, e: int, count: int = 1, batch: float = 1) -> tuple[float, float, int]:
    """`count` products of an (m x k) by a (k x n) matrix, `batch` of them in one kernel."""
    return 2.0 * m * k * n * batch, float(e) * batch * (m * k + k * n + m * n), count


def _weights(gemms: tuple, c) -> tuple[tuple, tuple]:
    """Forward and backward products of weight matrices given as `(m, k, n, count)` (tokens, in, out): the
    forward and the input gradient read and write their operands; the weight gradient accumulates into a
    `reduce_dtype` buffer inside the product (read and write the buffer: `fused_accumulation`), or the
    product writes a compute-dtype gradient which a separate add sums into the one held
    (`accumulation`, per step). Returns (forward, backward)."""
    e, g = ITEMSIZE[c.dtype], ITEMSIZE[c.reduce_dtype]
    fwd, back = [], []
    for m, k, n, count in gemms:
        fwd.append(_mm(m, k, n, e, count))
        back.append(_mm(m, n, k, e, count))
        grad = e * (m * k + m * n) + (2 * g * k * n if c.fused_accumulation else e * k * n)
        back.append((2.0 * m * k * n, grad, count))
    return tuple(fwd), tuple(back)


def accumulation(params: float, c, m: int) -> Compute:
    """Per microbatch, the adds that sum a step's `m` microbatch gradients of `params` weights where the
    product does not (`fused_accumulation` False: autograd's, adding each later microbatch's gradient into the
    one held, m - 1 adds a step): each reads the new compute-dtype gradient and the held one and writes the
    held one, in `reduce_dtype` where the runtime keeps main gradients or FSDP2 accumulates (ZeRO-2/3), else
    in the compute dtype."""
    if c.fused_accumulation:
        return Compute()
    e = ITEMSIZE[c.dtype]
    return Compute.accumulation(params, m, e, ITEMSIZE[c.reduce_dtype] if c.main_grads or c.zero >= 2 else e)


@dataclass(frozen=True, slots=True)
class _Layer:
    """One layer's parts: weight products `(m, k, n, count)`; the attention core forward and backward (its
    products and memory traffic, or one fused kernel); memory traffic outside the core forward and backward."""

    gemms: tuple
    core: Compute
    core_back: Compute
    bytes_fwd: float
    bytes_bwd: float


def widths(shape, t: int) -> tuple[float, float, float, float]:
    """Per-rank widths of q, k, v and the attention's output (kv heads fewer than t are replicated: each rank
    keeps one)."""
    kv = max(shape.kv_heads // t, 1) if shape.kv_heads < shape.heads else shape.kv_heads / t
    return (shape.heads * shape.head_dim / t, kv * shape.head_dim, kv * shape.v_head_dim,
            shape.heads * shape.v_head_dim / t)  # fmt: skip


def _attention(shape, c, b: int, seq: int, e: int) -> tuple[tuple, Compute, Compute]:
    """(projections, core forward, core backward) of one layer's attention."""
    t, h, n = c.tp, shape.hidden, b * seq // c.cp
    q, k, v, o = widths(shape, t)
    kv = k + v
    if shape.q_rank or shape.kv_rank:  # MLA: down-projections replicated over tp, up-projections split
        qr, kr = shape.q_rank or h, shape.kv_rank or h
        proj = ((n, h, qr, 1), (n, qr, q, 1)) if shape.q_rank else ((n, h, q, 1),)
        proj += ((n, h, kr, 1), (n, kr, kv, 1)) if shape.kv_rank else ((n, h, kv, 1),)
    else:
        proj = ((n, h, q + kv, 1),)
    proj += ((n, o, h, 1),)
    heads, sq, d, dv = b * shape.heads / t, seq // c.cp, shape.head_dim, shape.v_head_dim
    scores = heads * sq * seq
    if c.flash:  # one fused kernel, priced by its shape; backward recomputes the scores
        io = e * (n * (q + o) + b * seq * kv) + 4 * heads * sq  # read q, k, v; write out and log-sum-exp
        fwd, bwd = (Compute.attention_call(heads, sq, seq, d, dv, backward=back) for back in (False, True))
        return proj, Compute(bytes=io, ops=1, attention=(fwd,)), Compute(bytes=2 * io, ops=1, attention=(bwd,))
    qk, pv = _mm(sq, d, seq, e, batch=heads), _mm(sq, seq, dv, e, batch=heads)
    drop = (2 * e + 1) * scores if shape.dropout else 0.0
    fwd = 2 * e * scores + drop + 2 * e * n * o  # softmax, dropout, context transpose
    bwd = 3 * e * scores + drop + 2 * e * n * o
    return proj, Compute((qk, pv), bytes=fwd, ops=4), Compute((qk, qk, pv, pv), bytes=bwd, ops=6)


def _mlp(shape, c, n: int, e: int, moe: bool) -> tuple[tuple, float, float]:
    """(products, activation bytes forward, backward) of one layer's MLP or experts."""
    t, h = c.tp, shape.hidden
    act_f, act_b = (3 * e, 5 * e) if shape.gated else (2 * e, 3 * e)
    up = 2 if shape.gated else 1
    if not moe:
        w = shape.ffn / t
        return ((n, h, up * w, 1), (n, w, h, 1)), act_f * n * w, act_b * n * w
    k, w, local = shape.top_k, shape.moe_ffn / t, shape.experts // c.ep
    tokens = n * k * c.ep / shape.experts
    gemms = ((n, h, shape.experts, 1), (tokens, h, up * w, local), (tokens, w, h, local))
    shared = shape.shared_experts * w
    if shared:
        gemms += ((n, h, up * shared, 1), (n, shared, h, 1))
    routed = n * k * w + n * shared
    permute = 4 * e * n * k * h  # tokens copied into expert order and back
    return gemms, act_f * routed + permute, act_b * routed + permute


def _layer(shape, c, b: int, seq: int, moe: bool) -> _Layer:
    e, t, h = ITEMSIZE[c.dtype], c.tp, shape.hidden
    n = b * seq // c.cp
    rows = n / t if c.sp else n  # tokens the norms, dropouts and residuals run on
    proj, core, core_back = _attention(shape, c, b, seq, e)
    mlp, act_f, act_b = _mlp(shape, c, n, e, moe)
    q, k, _, _ = widths(shape, t)
    rope = 0.0 if shape.positions else 2 * e * n * (q + k)
    residual = (3 * e + (1 if shape.dropout else 0)) * rows * h
    fwd = 2 * (2 * e * rows * h) + 2 * residual + act_f + rope
    dropout_back = (2 * e + 1) * rows * h if shape.dropout else 0.0
    bwd = 2 * (3 * e * rows * h) + 2 * (3 * e * rows * h) + 2 * dropout_back + act_b + rope
    return _Layer(proj + mlp, core, core_back, fwd, bwd)


def _passes(layer: _Layer, c) -> Passes:
    fwd, back = _weights(layer.gemms, c)
    forward = Compute(fwd, bytes=layer.bytes_fwd, ops=20) + layer.core
    weight = Compute(back[1::2])
    backward = Compute(back, bytes=layer.bytes_bwd, ops=34) + layer.core_back
    if c.recompute == "block":
        recompute = forward
    elif c.recompute == "selective" and not c.flash:
        recompute = layer.core
    else:
        recompute = Compute()
    return Passes(forward, backward, recompute, weight)


def _ends(shape, c, n: int, embed: bool, head: bool) -> Passes:
    """The embedding (a lookup, positions and dropout; its gradient scattered into fp32) and the head: the
    final norm, the logits' product, and vocab-parallel cross-entropy in fp32 (upcast, max, exp and sum
    forward; softmax minus one-hot and the downcast backward)."""
    e, t, h, v = ITEMSIZE[c.dtype], c.tp, shape.hidden, shape.vocab / c.tp
    rows = n / t if c.sp else n
    f = b_ = 0.0
    fwd_mm: tuple = ()
    back_mm: tuple = ()
    if embed:
        f += e * n * h + (3 * e * rows * h if shape.positions else 0) + ((2 * e + 1) * rows * h if shape.dropout else 0)
        b_ += (e + 8) * n * h
    if head:
        fwd_mm, back_mm = _weights(((n, h, v, 1),), c)
        f += 2 * e * rows * h + (e + 20) * n * v
        b_ += 6 * e * rows * h + (12 + e) * n * v
    fwd = Compute(fwd_mm, bytes=f, ops=8)
    weight = Compute(back_mm[1::2])
    return Passes(fwd, Compute(back_mm, bytes=b_, ops=8), Compute(), weight)  # recompute keeps to the layers


# the `StepConfig` fields `stage_passes` reads (the rest, ZeRO and the data and pipeline degrees among them, do not
# change what a stage computes per microbatch); `transformer._passes` caches by them
COMPUTE_FIELDS = ("dtype", "reduce_dtype", "fused_accumulation", "tp", "cp", "sp", "ep", "recompute", "flash",
                  "cp_method")  # fmt: skip


def stage_passes(shape, c, b: int, seq: int, dense: int, moe: int, *, embed: bool, head: bool) -> Passes:
    """A pipeline rank's passes per microbatch: its `dense` and `moe` layers over all its chunks, and the
    embedding or the head where it holds them."""
    parts = [_ends(shape, c, b * seq // c.cp, embed, head)]
    parts += [_scaled(_layer_passes(shape, c, b, seq, False), dense)] if dense else []
    parts += [_scaled(_layer_passes(shape, c, b, seq, True), moe)] if moe else []
    return Passes(*(sum((getattr(p, k) for p in parts[1:]), getattr(parts[0], k))
                    for k in ("forward", "backward", "recompute", "weight")))  # fmt: skip


_LAYER_PASSES: dict = {}


def _layer_passes(shape, c, b: int, seq: int, moe: bool) -> Passes:
    """One layer's passes, computed once per set of the fields they read (`COMPUTE_FIELDS`)."""
    key = compute_key(shape, c, b, seq, moe)
    return remembered(_LAYER_PASSES, key, lambda: _passes(_layer(shape, c, b, seq, moe), c), 1 << 14)


def compute_key(shape, c, *rest) -> tuple:
    """What a stage's or a layer's passes depend on: the shape, `c`'s `COMPUTE_FIELDS`, and `rest`."""
    return (shape, *(getattr(c, f) for f in COMPUTE_FIELDS), *rest)


def remembered(store: dict, key, make, limit: int):
    """`store[key]`, made by `make()` the first time; `store` emptied once it holds more than `limit`."""
    found = store.get(key)
    if found is None:
        if len(store) > limit:
            store.clear()
        found = store[key] = make()
    return found


def _scaled(p: Passes, k: int) -> Passes:
    return Passes(p.forward.scaled(k), p.backward.scaled(k), p.recompute.scaled(k), p.weight.scaled(k))


def stage_params(shape, c, dense: int, moe: int, *, embed: bool, head: bool) -> tuple[float, float]:
    """(parameters outside the experts, expert parameters) one rank of this stage holds: tensor parallelism
    splits the matrices (MLA's down-projections too, an approximation) and leaves the norms whole."""
    t, norms = c.tp, 2 * shape._norm()
    layer = (shape._attention_params() - norms) / t + norms
    outside = dense * (layer + shape._mlp_params(shape.ffn) / t) + moe * (
        layer + (shape.hidden * shape.experts + shape.shared_experts * shape._mlp_params(shape.moe_ffn) / t)
    )
    experts = moe * shape.experts / c.ep * shape._mlp_params(shape.moe_ffn) / t if moe else 0.0
    if embed:
        outside += (shape.vocab / t + shape.positions) * shape.hidden
    if head:
        outside += shape._norm() + (0 if shape.tied and embed else shape.vocab * shape.hidden / t)
    return outside, experts


def largest_tensor(shape, c, dense: int, moe: int, *, embed: bool, head: bool) -> float:
    """Elements of the largest parameter tensor a rank of this stage holds: a projection or MLP matrix, the
    local experts' stacked matrices (one tensor, E/ep x 2·moe_ffn x hidden), the embedding or the head."""
    t, h = c.tp, shape.hidden
    q, k, v, o = widths(shape, t)
    sizes = [h * max(q, k, v, o)] if dense or moe else []
    sizes += [h * shape.ffn / t] if dense else []
    if moe:
        sizes += [h * 2 * shape.moe_ffn * shape.experts / c.ep / t, h * shape.moe_ffn * shape.shared_experts / t]
    sizes += [shape.vocab * h / t] if embed or head else []
    return max(sizes, default=0.0)


def mlp_width(shape, moe: bool) -> float:
    """A token's MLP width: the dense MLP's, or a MoE layer's top-k routed experts' and shared experts'."""
    return shape.moe_ffn * (shape.top_k + shape.shared_experts) if moe else shape.ffn


def chunk_activation(shape, c, b: int, seq: int, dense: int, moe: int) -> float:
    """Bytes one microbatch leaves for backward in `dense` and `moe` layers of a chunk (see the module)."""
    return dense * _kept(shape, c, b, seq, False) + moe * _kept(shape, c, b, seq, True)


def _kept(shape, c, b: int, seq: int, moe: bool) -> float:
    e, t, h = ITEMSIZE[c.dtype], c.tp, shape.hidden
    n = b * seq // c.cp
    rows = n / t if c.sp else n
    if c.recompute == "block":
        return e * rows * h
    q, k, v, o = widths(shape, t)
    mask = rows * h if shape.dropout else 0.0
    norms_and_inputs = 2 * e * rows * h + 2 * e * rows * h + 2 * mask  # norm inputs, QKV and MLP inputs
    attention = e * n * (q + k + v + o)  # q, k, v and the output projection's input
    scores = b * shape.heads / t * (seq // c.cp) * seq
    if c.flash:
        attention += 4 * b * shape.heads / t * (seq // c.cp)  # log-sum-exp per query row
    elif c.recompute == "none":
        attention += scores * (e + (1 + e if shape.dropout else 0))
    if c.cp > 1:
        attention += _context_kept(c, e, n, q, k, v, o)
    width = mlp_width(shape, moe)
    mlp = e * n * width / t * ((2 if shape.gated else 1) + 1)  # activation input(s) and the second matrix's input
    if moe:  # each (token, expert) pair's row in expert order (the products' input) and its output, which the
        pairs = n * shape.top_k  # combine keeps for the routing weights' gradient; four int64 permutations
        mlp += 2 * e * pairs * h + 4 * 8 * pairs
        mlp += n * (4 * h + 12 * shape.experts)  # the router's fp32 input copy, its scores and top-k choice
    if not c.fused_elementwise:  # unfused RMSNorm: its normalized input; unfused SwiGLU: the gate's activation
        norms_and_inputs += 2 * e * rows * h if shape.norm == "rmsnorm" else 0.0
        if shape.norm_fp32:  # norms that upcast keep their input's fp32 copy, not the input
            norms_and_inputs += 2 * (max(e, 4) - e) * rows * h
        mlp += e * n * width / t if shape.gated else 0.0
    return norms_and_inputs + attention + mlp


def _context_kept(c, e: int, n: int, q: float, k: float, v: float, o: float) -> float:
    """What context-parallel attention keeps besides plain flash attention's q, k, v, output and log-sum-exp:
    its output in the heads-first layout, which the model's reshape for the output projection copies; and,
    unless selective recompute runs the core again, the ring's last K/V shard to arrive (`ring_attention`),
    the all-gathered K and V (`allgather_attention`), or the fp32 queries and output of the all-to-all
    method's core for 16-bit inputs (`ulysses_attention`)."""
    out = e * n * o
    if c.recompute != "none":
        return out
    if c.cp_method == "ring":
        return out + e * n * (k + v)
    if c.cp_method == "all-gather":
        return out + e * n * (c.cp - 1) * (k + v)
    return out + (4 * n * (q + o) if e < 4 else 0.0)


def chunk_weight_residue(shape, c, b: int, seq: int, dense: int, moe: int) -> float:
    """Bytes one microbatch's chunk of `dense` and `moe` layers holds besides its activations between its
    input-gradient and weight-gradient passes (see the module)."""
    return dense * _residue(shape, c, b, seq, False) + moe * _residue(shape, c, b, seq, True)


def _residue(shape, c, b: int, seq: int, moe: bool) -> float:
    e, t, h = ITEMSIZE[c.dtype], c.tp, shape.hidden
    n = b * seq // c.cp
    rows = n / t if c.sp else n
    q, k, v, _ = widths(shape, t)
    width = mlp_width(shape, moe)
    up = (2 if shape.gated else 1) * width / t
    # under sequence parallelism the attention's and the MLP's inputs are all-gathered values, kept as shards
    # and gathered again when backward unpacks them: I does, for the input gradient, and they stay for W
    gathered = 2 * n * h if c.sp else 0.0
    return e * (2 * rows * h + n * (q + k + v) + n * h + n * up + n * h + gathered)  # norms', QKV, out, up, down


def head_activation(shape, c, n: int) -> float:
    """The last stage's fp32 logits, kept by cross-entropy for backward (one microbatch at a time)."""
    return 4.0 * n * shape.vocab / c.tp
