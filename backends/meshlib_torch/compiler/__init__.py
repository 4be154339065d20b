"""The compiler: a model and a mesh in, the whole program one rank runs and its plan out, with no process.

Its passes, in order (the one place they are written down; `compile.compile_model` runs them):

capture/        the model as an fx graph of global values
  trace           fx, or torch.export where fx fails; keyword inputs bound by name (`call`)
  moe, attention  experts (over ep) and, with a cp axis, scaled_dot_product_attention (ring attention) traced
                  as shard_map regions
  normalize       one op vocabulary for both tracers; grad-mode and autocast regions kept (`regions`)
  values          every node's global value and FLOPs; `values.annotate_run_dtypes` the dtypes it runs in
  blocks          each node's part: "pre", the model's layers, "post" (the units of FSDP2 and recompute)
placement/      each value's placement on each mesh axis, and the graph one rank runs
  annotate        parameter specs from the rules, input specs from the user; fused projections' parts
  propagate       a placement for every value, the cheapest the op rules (`ops`) allow
  redistribute    exactly the collectives the placements need, each with its backward
  localize        every node on its rank's shard; the rank-dependent ops (`rank_ops`: the vocab-parallel
                  embedding and loss, a region of per-shard code), run by `modules.special`
estimates/      what the program moves and holds, per rank and step
  records         the plan's collectives, with bytes and provenance
  saved           what each op keeps for backward: what recompute and backward run again, what a layer keeps
  dryrun          the peak, by running the program on meta tensors (`stepmem`: the optimizer's step)
pipeline/       with a pp axis: the program of one microbatch cut into stages
  costs           stage costs and the balanced split
  stages          one graph per stage, and what crosses each boundary (`fqn_split`: the eager model's)
  compile         the stages, the schedule, and the plan of each pp rank

`graph.compile_graph` runs capture and placement for one graph; `pipeline.compile.compile_pipeline`
cuts its result into stages; `program` holds what the runtime is handed (`Compiled`).
"""
