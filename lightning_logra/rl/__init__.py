"""The RL step's plain-torch pieces, used by ``GRPOModule`` and by the benchmarks: the loss
configuration (``config``), chunked token log-probs (``logprobs``), advantages and losses
(``losses``), rollout scoring and group sampling (``sampling``), step metrics (``metrics``)
and the few collectives they need (``collectives``). Nothing here imports Lightning."""
