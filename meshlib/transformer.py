"""A decoder-only transformer's training step in closed form: `ModelShape`, `StepConfig`, `workload()`.

The planner cannot trace a 400B-parameter model for every configuration it tries; it writes the step down
instead. `workload(shape, config, batch=, seq=)` returns the `Workload` that `meshlib.predict` times: per
pipeline rank, the forward, backward and recompute of one microbatch (every matrix product by size, every
other op as its memory traffic), the collectives each runs, the activations a stage sends on, the
per-step gradient sync and optimizer, and the peak memory per rank. The per-layer parts live in
`meshlib.transformer_work` (compute and activation memory) and `meshlib.transformer_comm` (collectives).

The counts follow the published analyses: Narayanan et al. 2021 (FLOPs, interleaved pipelines),
Korthikanti et al. 2022 (activation memory, sequence parallelism, selective recompute), the ZeRO paper
(model state, `meshlib.cost`). `Workload.model_flops` is the model's forward and backward once (no
recompute) with attention counted whole (no causal discount), as MFU is reported (Korthikanti's
72·B·s·l·h²(1 + s/6h + V/12lh); torchtitan's and PaLM's 6N + 12·l·h·s per token).

Example:
    >>> gpt3 = ModelShape(layers=96, hidden=12288, heads=96, ffn=49152, vocab=50257, positions=2048,
    ...                   bias=True, tied=True, dropout=True)
    >>> round(gpt3.params() / 1e9, 1)
    174.6
    >>> w = workload(gpt3, StepConfig(dp=1, tp=8, pp=8, microbatch=1, schedule="interleaved-1f1b", chunks=3,
    ...              recompute="selective", sp=True, flash=False), batch=64, seq=2048)
    >>> w.mesh, w.microbatches, w.chunks
    (Mesh(pp=8, dp=1, cp=1, ep=1, tp=8), 64, 3)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields, replace

from . import transformer_comm as _comm
from . import transformer_work as _work
from .mesh import Mesh
from .schedules import resolve_schedule, splits_backward
from .schedules import schedule as build_schedule
from .workload import Compute, StageWork, Workload

__all__ = [
    "CP_METHODS", "RECOMPUTE_MODES", "TP_OVERLAPS", "ModelShape", "StepConfig", "compute_bound", "scheduled_peaks",
    "waiting_peaks", "workload",
]  # fmt: skip

RECOMPUTE_MODES = ("none", "selective", "block")
CP_METHODS = ("ring", "all-gather", "all-to-all")
TP_OVERLAPS = ("none", "backward", "all")
ZERO1_OVERLAPS = ("all", "backward", "none")
ITEMSIZE = _work.ITEMSIZE


def _positive(obj, names: tuple[str, ...], minimum: int = 1) -> list[str]:
    return [f"{n}={getattr(obj, n)!r} must be an int >= {minimum}" for n in names
            if not isinstance(getattr(obj, n), int) or isinstance(getattr(obj, n), bool)
            or getattr(obj, n) < minimum]  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A decoder-only transformer. `kv_heads` (0: `heads`), `head_dim` (0: hidden // heads) and `v_head_dim`
    (0: `head_dim`) shape attention; `q_rank`, `kv_rank` (0: full rank) give MLA's low-rank projections
    (DeepSeek-V2/V3; the decoupled RoPE key is counted inside each head's key). `gated`: SwiGLU (three MLP
    matrices, else two). `experts` (0: dense) routed experts of width `moe_ffn` (0: `ffn`), `top_k` of them
    per token, plus `shared_experts` of that width; the first `dense_layers` layers stay dense. `tied`: the
    head reuses the embedding. `norm`: "layernorm" (weight and bias) or "rmsnorm". `bias`: linear biases
    (GPT). `qkv_bias`: biases on the query, key and value projections alone (Qwen2). `positions`: learned
    position embeddings (GPT; 0: rotary). `dropout`: attention and hidden dropout during training (GPT-3,
    Megatron's GPT; their masks are kept for backward). `norm_fp32`: the norms compute in fp32 whatever the
    compute dtype (transformers' RMSNorm upcasts its input, and keeps that fp32 copy for backward)."""

    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    q_rank: int = 0
    kv_rank: int = 0
    gated: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    tied: bool = False
    norm: str = "layernorm"
    bias: bool = False
    positions: int = 0
    dropout: bool = False
    qkv_bias: bool = False
    norm_fp32: bool = False

    def __post_init__(self):
        problems = _positive(self, ("layers", "hidden", "heads", "ffn", "vocab"))
        problems += _positive(self, ("kv_heads", "head_dim", "v_head_dim", "q_rank", "kv_rank", "experts", "top_k",
                                     "moe_ffn", "shared_experts", "dense_layers", "positions"), minimum=0)  # fmt: skip
        if problems:
            raise ValueError("ModelShape: " + "; ".join(problems))
        _set = object.__setattr__
        _set(self, "kv_heads", self.kv_heads or self.heads)
        _set(self, "head_dim", self.head_dim or self.hidden // self.heads)
        _set(self, "v_head_dim", self.v_head_dim or self.head_dim)
        if self.experts:
            _set(self, "moe_ffn", self.moe_ffn or self.ffn)
        self._check()

    def _check(self):
        problems = []
        if self.heads % self.kv_heads:
            problems.append(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads} (grouped queries)")
        if self.norm not in ("layernorm", "rmsnorm"):
            problems.append(f"norm={self.norm!r}: use 'layernorm' or 'rmsnorm'")
        if self.experts and not 1 <= self.top_k <= self.experts:
            problems.append(f"top_k={self.top_k} must lie in 1..experts={self.experts}: set top_k for an MoE model")
        if not self.experts and (self.top_k or self.shared_experts or self.dense_layers):
            problems.append("top_k, shared_experts and dense_layers describe experts: set experts > 0, or leave them 0")
        if self.dense_layers > self.layers:
            problems.append(f"dense_layers={self.dense_layers} exceeds layers={self.layers}")
        if problems:
            raise ValueError("ModelShape: " + "; ".join(problems))

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.experts else 0

    def params(self) -> int:
        """The exact parameter count (embeddings, every layer, the final norm and the head).

        Example:
            >>> llama3_405b = ModelShape(layers=126, hidden=16384, heads=128, kv_heads=8, ffn=53248,
            ...                          vocab=128256, gated=True, norm="rmsnorm")
            >>> round(llama3_405b.params() / 1e9, 2)
            405.85
        """
        h = self.hidden
        embed = self.vocab * h * (1 if self.tied else 2) + self.positions * h
        dense = self.layers - self.moe_layers
        return (
            embed
            + self._norm()
            + self.layers * self._attention_params()
            + dense * self._mlp_params(self.ffn)
            + (self.moe_layers * self._moe_params())
        )

    def _norm(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def _attention_params(self) -> int:
        h, q, o = self.hidden, self.heads * self.head_dim, self.heads * self.v_head_dim
        kv, v = self.kv_heads * self.head_dim, self.kv_heads * self.v_head_dim
        q_proj = h * self.q_rank + self.q_rank + self.q_rank * q if self.q_rank else h * q
        kv_proj = h * self.kv_rank + self.kv_rank + self.kv_rank * (kv + v) if self.kv_rank else h * (kv + v)
        biases = (q + kv + v + h) if self.bias else (q + kv + v) if self.qkv_bias else 0
        return q_proj + kv_proj + o * h + biases + 2 * self._norm()

    def _mlp_params(self, width: int) -> int:
        up = 2 * width if self.gated else width
        return self.hidden * (up + width) + ((up + self.hidden) if self.bias else 0)

    def _moe_params(self) -> int:
        expert = self._mlp_params(self.moe_ffn)
        return self.hidden * self.experts + (self.experts + self.shared_experts) * expert

    def matmul_params(self) -> int:
        """Weights a token multiplies by in one forward (the experts it is routed to, the head; no embedding)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * (self.head_dim + self.v_head_dim)
        q_proj = self.q_rank * (h + q) if self.q_rank else h * q
        kv_proj = self.kv_rank * (h + kv) if self.kv_rank else h * kv
        attention = q_proj + kv_proj + self.heads * self.v_head_dim * h
        width = self.moe_ffn * (self.top_k + self.shared_experts)
        dense = self.layers - self.moe_layers
        mlp = dense * _mm_weights(self, self.ffn) + self.moe_layers * (_mm_weights(self, width) + h * self.experts)
        return self.layers * attention + mlp + self.vocab * h

    def forward_flops(self, tokens: int, seq: int, *, causal: bool = False) -> float:
        """FLOPs of one forward over `tokens` tokens in sequences of `seq`: 2 per weight a token multiplies by,
        and attention's two products, 2·seq·heads·(head_dim + v_head_dim) per token and layer (halved with
        `causal`, as causal kernels skip the masked half; MFU conventions count it whole).

        Example:
            >>> s = ModelShape(layers=2, hidden=64, heads=4, ffn=256, vocab=100)
            >>> s.forward_flops(8, 8) == 8 * (24 * 2 * 64**2 + 4 * 2 * 8 * 64 + 2 * 64 * 100)
            True
        """
        attention = 2 * seq * self.heads * (self.head_dim + self.v_head_dim) * self.layers
        return float(tokens) * (2 * self.matmul_params() + attention * (0.5 if causal else 1.0))


def _mm_weights(shape: ModelShape, width: int) -> int:
    return shape.hidden * width * (3 if shape.gated else 2)


@dataclass(frozen=True, slots=True)
class StepConfig:
    """How a step runs: the mesh (`dp` × `ep` data ranks, `tp`, `pp`, `cp`), the ZeRO level, `recompute`
    ("none", "selective": Megatron's recompute of the attention core, "block": every layer from its input),
    `sp` (sequence parallelism), `microbatch` sequences per microbatch per data rank, the pipeline
    `schedule` and its `chunks` per rank, `cp_method` ("ring", "all-gather", "all-to-all"), the compute
    `dtype`, and how the runtime runs it where that changes the time:

    - `flash`: attention is one fused kernel (FlashAttention, cuDNN): no seq×seq scores in memory, causal
      blocks skipped, scores recomputed in backward; False: Megatron's 2022 path (scores written out, a
      fused scale-mask-softmax, every product computed whole);
    - `dp_overlap`: gradient reductions run while backward still computes (bucketed DDP, FSDP) and ZeRO's
      parameter gathers are prefetched; False: they run after the pipeline flushes (Megatron-LM 2021-22);
    - `pp_dp_overlap`: with `dp_overlap` and a pipeline, the gradient reductions of ZeRO-0 and ZeRO-2/3 run
      behind each stage's last microbatch's backward (Megatron's `overlap_grad_reduce`); False: after that
      backward (meshlib's runtime on torch's pipelining: ZeRO-0's buckets are summed after the schedule, and
      FSDP2 reduce-scatters a stage's gradients once its last backward has returned), so the rank that
      finishes the schedule last waits for them;
    - `zero1_overlap`: with `dp_overlap`, "all": ZeRO-1's reduce-scatters run behind backward and its
      gathers behind the next forward (Megatron's distributed optimizer, `overlap_grad_reduce` and
      `overlap_param_gather`); "backward": the reduce-scatters behind the last microbatch's backward where
      no pipeline runs, the gathers in the optimizer step, and each rank holds its summed pieces beside
      the gradients from backward's end into the step (meshlib's runtime); "none": both in the step;
    - `tp_overlap`: "none"; "backward": Megatron's asynchronous input-gradient collective, hidden behind the
      weight-gradient product of the same linear (and sequence parallelism's re-gather behind the
      input-gradient product); "all": every tensor-parallel collective behind a matrix product;
    - `reduce_dtype`: the dtype gradients accumulate and reduce in (Megatron's fp32 main grads);
    - `main_grads`: below ZeRO-2 each rank keeps its gradients in `reduce_dtype` (Megatron's main grads);
      False: in the compute dtype (meshlib's runtime at ZeRO-0/1). ZeRO-2/3 keep `reduce_dtype` shards;
    - `fused_accumulation`: the weight-gradient product adds into that buffer itself (Megatron's gradient
      accumulation fusion, from February 2022); False: a separate add per weight and every microbatch but
      the first (autograd's, as meshlib's runtime runs: `transformer_work.accumulation`);
    - `fused_elementwise`: RMSNorm and SwiGLU are fused kernels that keep only their inputs for backward
      (Megatron, TransformerEngine); False: they run as separate ops (meshlib's bundled Llama, torch eager),
      and each RMSNorm keeps its normalized input and SwiGLU its gate's activation as well;
    - `async_p2p`: pipeline sends run behind compute (Llama 3, torch.distributed.pipelining); False: every
      exchange between stages is waited for by both ranks (Megatron-LM 2021-22 synchronizes after each),
      and without sequence parallelism the receiver all-gathers the message over tp (Megatron's
      scatter-gather optimization);
    - `recv_buffers`: buffers a pipeline stage receives into, made for every microbatch when the schedule
      is set up and kept through the step: 0 (Megatron allocates each as it receives), 1 (each stage's
      input: torch.distributed.pipelining), 2 (its output's gradient too: torch 2.13, which later releases
      allocate at each receive).
    """

    dp: int
    tp: int
    pp: int
    ep: int = 1
    cp: int = 1
    zero: int = 0
    recompute: str = "none"
    sp: bool = False
    microbatch: int = 1
    schedule: str = "1f1b"
    chunks: int = 1
    cp_method: str = "ring"
    dtype: str = "bfloat16"
    flash: bool = True
    dp_overlap: bool = True
    pp_dp_overlap: bool = True
    zero1_overlap: str = "all"
    tp_overlap: str = "none"
    reduce_dtype: str = "float32"
    main_grads: bool = True
    fused_accumulation: bool = True
    fused_elementwise: bool = True
    async_p2p: bool = True
    recv_buffers: int = 0

    def __post_init__(self):
        problems = _positive(self, ("dp", "tp", "pp", "ep", "cp", "microbatch", "chunks"))
        choices = {"recompute": RECOMPUTE_MODES, "cp_method": CP_METHODS, "tp_overlap": TP_OVERLAPS,
                   "dtype": tuple(ITEMSIZE), "reduce_dtype": tuple(ITEMSIZE), "zero": (0, 1, 2, 3),
                   "recv_buffers": (0, 1, 2), "zero1_overlap": ZERO1_OVERLAPS}  # fmt: skip
        problems += [f"{k}={getattr(self, k)!r}: use one of {v}" for k, v in choices.items()
                     if getattr(self, k) not in v]  # fmt: skip
        if self.sp and self.tp == 1:
            problems.append("sp=True needs tp > 1 (sequence parallelism splits what tensor parallelism replicates)")
        if self.pp > 1:
            try:
                resolve_schedule(self.schedule, self.chunks)
            except ValueError as err:
                problems.append(f"schedule={self.schedule!r}, chunks={self.chunks}: {err}")
        if problems:
            raise ValueError("StepConfig: " + "; ".join(problems))

    @property
    def mesh(self) -> Mesh:
        """The mesh, outermost axis first as Megatron orders its ranks (pp, dp, cp, ep, tp): tp inside a node,
        and the data axes (dp, cp, ep) neighbours, as FSDP2 needs to shard over them together."""
        return Mesh(pp=self.pp, dp=self.dp, cp=self.cp, ep=self.ep, tp=self.tp)

    def replace(self, **changes) -> StepConfig:
        return StepConfig(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **changes})


def workload(shape: ModelShape, config: StepConfig, *, batch: int, seq: int) -> Workload:
    """One training step of `shape` run as `config`: `batch` sequences of `seq` tokens (global)."""
    m = _check(shape, config, batch, seq)
    v = config.chunks if config.pp > 1 else 1
    name = resolve_schedule(config.schedule, config.chunks)[0] if config.pp > 1 else ""
    split = _work.layer_split(shape, config.pp, v, zbv=name == "zbv")
    peaks = _split_peaks(shape, config, name, seq, m, v, split) if config.pp > 1 else ((1, 0),)
    stages = tuple(_stage(shape, config, name, seq, m, r, split[r], peaks[r]) for r in range(config.pp))
    return Workload(mesh=config.mesh, stages=stages, tokens=batch * seq,
                    model_flops=3 * shape.forward_flops(batch * seq, seq), dtype=config.dtype, schedule=name,
                    microbatches=m, chunks=v)  # fmt: skip


def compute_bound(shape: ModelShape, config: StepConfig, *, batch: int, seq: int, profile) -> float:
    """A lower bound on the step time of `config`: its busiest pipeline rank's forward and backward compute
    over the step's microbatches and the adds accumulating their gradients in the compute dtype, with no
    recompute, communication, bubble or optimizer (what every configuration sharing its tp, cp, ep and
    microbatch computes at least). Cheap: the stages' compute is cached (`_passes`)."""
    from .predict import compute_time

    m = _check(shape, config, batch, seq)
    c = config if config.recompute == "none" else config.replace(recompute="none")
    least = c.replace(zero=0, main_grads=False)  # the gradient accumulation's least bytes, whatever the ZeRO level
    v = c.chunks if c.pp > 1 else 1
    busiest = 0.0
    zbv = c.pp > 1 and resolve_schedule(c.schedule, c.chunks)[0] == "zbv"
    for r, chunks in enumerate(_work.layer_split(shape, c.pp, v, zbv)):
        dense, moe = sum(d for d, _ in chunks), sum(x for _, x in chunks)
        first, last = r == 0, r == _head_rank("zbv" if zbv else "", c.pp)
        p = _passes(shape, c, c.microbatch, seq, dense, moe, first, last)
        added = _work.accumulation(sum(_work.stage_params(shape, c, dense, moe, embed=first, head=last)), least, m)
        t = compute_time(p.forward, profile, c.dtype) + compute_time(p.backward + added, profile, c.dtype)
        busiest = max(busiest, t)
    return busiest * m


def _check(shape: ModelShape, c: StepConfig, batch: int, seq: int) -> int:
    """The microbatches per step; raises naming what does not divide."""
    data = c.dp * c.ep
    problems = []
    if batch % (data * c.microbatch):
        problems.append(f"batch={batch} must be a multiple of dp*ep*microbatch={data * c.microbatch}")
    if seq % c.cp:
        problems.append(f"seq={seq} must be a multiple of cp={c.cp}")
    if shape.heads % c.tp:
        problems.append(f"heads={shape.heads} must be a multiple of tp={c.tp}")
    if c.sp and seq // c.cp % c.tp:
        problems.append(f"seq/cp={seq // c.cp} must be a multiple of tp={c.tp} under sequence parallelism")
    if c.ep > 1 and (not shape.experts or shape.experts % c.ep):
        problems.append(f"ep={c.ep} must divide experts={shape.experts}")
    if shape.layers < c.pp:
        problems.append(f"pp={c.pp} stages need at least as many layers (layers={shape.layers})")
    elif c.pp > 1 and c.pp * c.chunks > shape.layers + 2:
        problems.append(f"pp x chunks = {c.pp * c.chunks} stages: at most layers + 2 = {shape.layers + 2}, the "
                        "first and the last holding only the embedding and the head")  # fmt: skip
    if problems:
        raise ValueError("workload: " + "; ".join(problems))
    return batch // (data * c.microbatch)


@functools.lru_cache(maxsize=1024)
def _peaks(name: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """Stage-chunk activations each pipeline rank holds at its peak: closed forms of the schedules' orders
    (`meshlib.schedules`; the test checks them against the orders), else counted on the schedule itself."""
    name = resolve_schedule(name, v if v > 1 else None)[0]
    if name in ("1f1b", "zb-h1") and v == 1:
        return tuple(min(p - r, m) for r in range(p))
    if name == "gpipe":
        return (m,) * p
    if name == "interleaved-1f1b":
        return tuple(min(m * v, (v - 1) * p + 2 * (p - r - 1) + 1) for r in range(p))
    if name == "zbv":
        return tuple(min(2 * p, 2 * m, m + r + 1) for r in range(p))
    return scheduled_peaks(name, p, m, v)


def _split_peaks(shape: ModelShape, c: StepConfig, name: str, seq: int, m: int, v: int, split: tuple) -> tuple:
    """Per pipeline rank, (chunk-microbatches holding activations, of them waiting for their weight gradient)
    at its peak under schedule `name` (canonical), in units of the rank's largest chunk (`_stage_of`'s `act`
    and `residue`): where the rank's chunks are alike, `_peaks` and none waiting where backward is not split,
    else counted on the schedule (`waiting_peaks`), a waiting chunk weighing its activations and its residue;
    where they differ (uneven layers, a stage with only the embedding or the head), each chunk weighed by its
    own (`_weighted_peak`)."""
    split_backward = splits_backward(name)
    out = []
    for r, chunks in enumerate(split):
        act, res = _chunk_bytes(shape, c, seq, chunks)
        top, top_res = max(act), max(res)
        if len(set(act)) == 1 and len(set(res)) == 1:
            out.append(waiting_peaks(name, c.pp, m, v, round(top_res / top, 2) if top else 0.0)[r] if split_backward
                       else (_peaks(c.schedule, c.pp, m, v)[r], 0))  # fmt: skip
        else:  # nothing waits for W where backward is not split: the residues weigh nothing there
            out.append((_weighted_peak(name, c.pp, m, v, r, act, res) / top, 0))
    return tuple(out)


def _chunk_bytes(shape: ModelShape, c: StepConfig, seq: int, chunks: tuple) -> tuple[tuple, tuple]:
    """Per chunk (`(dense, moe)` layers, in stage order), one microbatch's activations and its residue while it
    waits for W: its layers' (`chunk_activation`, `chunk_weight_residue`), or for a chunk without a layer (the
    embedding alone, or the head alone) the hidden state it keeps for backward, one send's bytes."""
    b = c.microbatch
    layer = [(f(shape, c, b, seq, 1, 0), f(shape, c, b, seq, 0, 1) if shape.moe_layers else 0.0)  # chunks add them
             for f in (_work.chunk_activation, _work.chunk_weight_residue)]  # fmt: skip
    row = _comm.send_bytes(shape, c, b * seq // c.cp)
    return tuple(tuple(d * dense + x * moe if d + x else (row if kind == 0 else 0.0) for d, x in chunks)
                 for kind, (dense, moe) in enumerate(layer))  # fmt: skip


@functools.lru_cache(maxsize=4096)
def _weighted_peak(name: str, p: int, m: int, v: int, rank: int, act: tuple, residue: tuple) -> float:
    """The most bytes rank `rank` holds at once, its chunks (in stage order) holding `act` bytes a microbatch
    from F to B (to W where backward is split) and, waiting for W, `residue` more."""
    return max(sum(n * a for n, a in zip(state, act + residue)) for state in _chunk_states(name, p, m, v)[rank])


@functools.lru_cache(maxsize=256)
def _chunk_states(name: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """Per rank, the distinct states its order passes through: per chunk (in stage order) the microbatches
    holding activations, then per chunk those waiting for W."""
    out = []
    for row in build_schedule(name, p, m, v if v > 1 else None).actions:
        local = {stage: i for i, stage in enumerate(sorted({a.stage for a in row}))}
        k = len(local)
        state = [0] * (2 * k)
        seen = {tuple(state): None}
        for a in row:
            i = local[a.stage]
            state[i] += (a.kind == "F") - (a.kind in "BW")
            state[k + i] += (a.kind == "I") - (a.kind == "W")
            seen[tuple(state)] = None
        out.append(tuple(seen))
    return tuple(out)


@functools.lru_cache(maxsize=4096)
def waiting_peaks(name: str, p: int, m: int, v: int, weight: float) -> tuple[tuple[int, int], ...]:
    """Per rank of a schedule that splits backward, (chunks holding activations: from F to W, as torch's
    pipelining retains the graph through I; of them waiting: from I to W) at the moment `holding + weight *
    waiting` peaks on the rank's own order (the first such moment)."""
    out = []
    for states in _waiting_states(name, p, m, v):
        best = (0, 0)
        for live, waiting in states:
            if live + weight * waiting > best[0] + weight * best[1]:
                best = (live, waiting)
        out.append(best)
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _waiting_states(name: str, p: int, m: int, v: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per rank, the distinct (holding, waiting) counts its order passes through, in the order first reached:
    a search prices many weights on one schedule, and the schedule is built once for them (`_chunk_states`,
    its chunks summed)."""
    out = []
    for states in _chunk_states(name, p, m, v):
        k = len(states[0]) // 2
        out.append(tuple(dict.fromkeys((sum(s[:k]), sum(s[k:])) for s in states)))
    return tuple(out)


def scheduled_peaks(name: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """`_peaks` counted on the schedule's own per-rank orders."""
    out = []
    for row in build_schedule(name, p, m, v if v > 1 else None).actions:
        live = peak = 0
        for a in row:
            live += (a.kind == "F") - (a.kind in "BI")
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


def _stage(shape: ModelShape, c: StepConfig, name: str, seq: int, m: int, rank: int, chunks: tuple,
           peak: tuple) -> StageWork:  # fmt: skip
    """The ranks at pipeline coordinate `rank` holding `peak` (chunk-microbatches holding activations, of them
    waiting for W) at their peak under schedule `name` (`_stage_of`: alike stages computed once, whatever they
    hold)."""
    first, last = rank == 0, rank == _head_rank(name, c.pp)
    work, state, act, residue, head, recomputed, update = _stage_of(shape, c, seq, m, first, last, chunks)
    full, waiting = peak
    received = _received(shape, c, name, seq, m, rank, len(chunks))
    transient = _weight_pass(shape, c, name, chunks) + recomputed
    return replace(work, memory=int(state + received + max(act * full + residue * waiting + head + transient, update)))


def _head_rank(name: str, pp: int) -> int:
    """The pipeline rank holding the last stage (the head) under schedule `name`: rank 0 on ZB-V's V."""
    return 0 if name == "zbv" else pp - 1


def _update(shape: ModelShape, c: StepConfig, dense: int, moe: int, params: tuple, first: bool, last: bool) -> float:
    """What the optimizer step holds above the model state in meshlib's runtime (`main_grads=False`; Megatron's
    fused optimizer is left out): under mixed precision below ZeRO-2, a full-precision copy of each gradient
    it steps on, kept until the update ends; ZeRO-1's summed pieces where backward reduce-scattered them
    (`zero1_overlap`; in fp32 they are those copies); and torch's AdamW, one tensor at a time, two
    full-precision temporaries the size of the largest (`meshlib_torch`'s `stepmem` measures these on meta
    tensors)."""
    if c.main_grads:
        return 0.0
    shards = (c.dp * c.cp * c.ep, c.dp * c.cp)
    stepped = sum(p / (n if c.zero else 1) for p, n in zip(params, shards))
    copies = 4 * stepped if ITEMSIZE[c.dtype] < 4 and c.zero < 2 else 0.0
    if _comm.zero1_in_backward(c):  # the reduce-scattered pieces, held from backward's end (the copies, in fp32)
        pieces = ITEMSIZE[c.reduce_dtype] * stepped
        copies = max(copies, pieces) if ITEMSIZE[c.reduce_dtype] == 4 else copies + pieces
    largest = _work.largest_tensor(shape, c, dense, moe, embed=first, head=last)
    return copies + 8 * largest / (shards[0] if c.zero else 1)


def _recomputed(shape: ModelShape, c: StepConfig, seq: int, chunks: tuple) -> float:
    """What backward holds at once under block recompute: one layer's activations, made again by its
    recomputed forward, and the gradients of its MLP's widest activations as its backward makes them (the
    rank's largest layer). Without recompute backward also holds those gradients beyond what forward kept
    (0.3 of a layer on llama-small); the closed form leaves that out."""
    if c.recompute != "block":
        return 0.0
    again, b, e = c.replace(recompute="none"), c.microbatch, ITEMSIZE[c.dtype]
    n = b * seq // c.cp
    kinds = [moe for moe in (False, True) if any(x if moe else d for d, x in chunks)]
    return max((_work.chunk_activation(shape, again, b, seq, int(not moe), int(moe))
                + e * n * _work.mlp_width(shape, moe) / c.tp * (2 if shape.gated else 1) for moe in kinds),
               default=0.0)  # fmt: skip


def _weight_pass(shape: ModelShape, c: StepConfig, name: str, chunks: tuple) -> float:
    """What a weight-gradient action (W) makes at once where backward is split: torch's pipelining computes
    a chunk's weight gradients in one `autograd.grad` call, all of them alive until it hands them on (in
    the compute dtype; the largest chunk of the rank's)."""
    if c.pp == 1 or not splits_backward(name):
        return 0.0
    grads = max(sum(_work.stage_params(shape, c, d, x, embed=False, head=False)) for d, x in chunks)
    return ITEMSIZE[c.dtype] * grads


def _received(shape: ModelShape, c: StepConfig, name: str, seq: int, m: int, rank: int, v: int) -> float:
    """The bytes pipeline rank `rank`, holding `v` stages, keeps in receive buffers (`recv_buffers`): per
    microbatch, each stage's input but the first stage's, and each stage's output gradient but the last's
    (on rank 0 where the stages run down and back up, a V)."""
    if c.pp == 1 or not c.recv_buffers:
        return 0.0
    last = _head_rank(name, c.pp)
    buffers = v - (rank == 0) + (v - (rank == last) if c.recv_buffers > 1 else 0)
    return m * buffers * _comm.send_bytes(shape, c, c.microbatch * seq // c.cp)


@functools.lru_cache(maxsize=1 << 17)
def _stage_of(shape: ModelShape, c: StepConfig, seq: int, m: int, first: bool, last: bool,
              chunks: tuple) -> tuple[StageWork, float, float, float, float, float, float]:  # fmt: skip
    """The ranks holding `chunks` (`(dense, moe)` layers each): the embedding on the first, the head and loss on
    the last. Their work (memory 0), and the bytes of their model state, of one chunk-microbatch's
    activations, of its residue while it waits for W, of the head's logits, of a layer recomputed in backward
    (`_recomputed`) and of the optimizer step (`_update`)."""
    b = c.microbatch
    n = b * seq // c.cp
    dense, moe = sum(d for d, _ in chunks), sum(x for _, x in chunks)
    passes = _passes(shape, c, b, seq, dense, moe, first, last)
    params = _work.stage_params(shape, c, dense, moe, embed=first, head=last)
    added = _work.accumulation(sum(params), c, m)  # per microbatch, in backward (in W where it runs apart)
    passes = _work.Passes(passes.forward, passes.backward + added, passes.recompute, passes.weight + added)
    act, residue = (max(per) for per in _chunk_bytes(shape, c, seq, chunks))
    tied = shape.tied and c.pp > 1 and (first or last)
    work = StageWork(
        forward=passes.forward, backward=passes.backward, recompute=passes.recompute, weight=passes.weight,
        comm=_comm.stage_comm(shape, c, b, seq, dense, moe, embed=first, head=last),
        send=_comm.send_bytes(shape, c, n) if c.pp > 1 and c.async_p2p else 0.0,
        step_comm=_comm.step_comm(params, c, m, tied=tied, embed_bytes=shape.vocab * shape.hidden / c.tp),
        optimizer=_optimizer(params, c), memory=0,
    )  # fmt: skip
    head = _work.head_activation(shape, c, n) if last else 0.0
    return (work, _comm.model_state(params, c), act, residue, head, _recomputed(shape, c, seq, chunks),
            _update(shape, c, dense, moe, params, first, last))  # fmt: skip


_PASSES: dict = {}


def _passes(shape: ModelShape, c: StepConfig, b: int, seq: int, dense: int, moe: int, first: bool, last: bool):
    """`transformer_work.stage_passes`, computed once per set of the fields it reads (`COMPUTE_FIELDS`): a
    search tries many configurations that compute alike (other ZeRO levels, data and pipeline degrees)."""
    key = _work.compute_key(shape, c, b, seq, dense, moe, first, last)
    make = lambda: _work.stage_passes(shape, c, b, seq, dense, moe, embed=first, head=last)  # noqa: E731
    return _work.remembered(_PASSES, key, make, 1 << 16)


def _optimizer(params: tuple[float, float], c: StepConfig) -> Compute:
    """AdamW over the rank's shard of the model state, bound by memory: read the fp32 gradient, master weight
    and two moments and write the three back and the compute-dtype copy (30 bytes a parameter), read the
    gradient again for its norm (4), and zero the local gradient buffer (4 a gradient). Its few FLOPs a
    parameter are elementwise and hide behind the traffic, so they are not counted."""
    shards = (c.dp * c.ep * c.cp, c.dp * c.cp)
    shard = sum(p / (n if c.zero else 1) for p, n in zip(params, shards))
    grads = sum(p / (n if c.zero >= 2 else 1) for p, n in zip(params, shards))
    return Compute(bytes=34 * shard + 4 * grads, ops=24)
