"""The decode policy: the one object that decides, for every hot decode op, whether a Pallas kernel or the XLA
reference runs, and with which tuning.

Built once (from the CLI or the `Engine` arguments) and passed down to every op's api; it is frozen and
hashable, so it can be a static argument of `jax.jit` (never an environment variable read while tracing,
which no jit cache key sees). Each api goes through `dispatch`, which runs the kernel where the policy asks
for kernels and the kernel accepts the call (a kernel raises NotImplementedError for what it does not take),
else the reference; a refusal is logged once on logger "k3jax.backends" and every choice is recorded in the
active `DispatchLog`s, which is how `k3jax-generate --json` says what ran.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import pathlib
from collections.abc import Callable, Iterator

BACKENDS = ("auto", "latency_specialized")  # auto = stock XLA everywhere (the default, as in vLLM)
BACKEND_ALIASES = {"xla": "auto"}
MOE_IMPLS = ("packed", "gather")  # how the XLA routed experts read MXFP4: straight from the codes, or a bf16 copy
TUNED_OPS = ("gemv", "kda_decode", "collectives", "moe", "mla_decode")  # ops with a tuning.json beside their api
SCALE_MAX_UNKNOWN = 255  # DecodePolicy.expert_scale_max where nobody looked at the weights (E8M0's NaN byte)


@functools.cache
def _parse(text: str) -> dict:
    return json.loads(text)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Each op's tuning table (its tuning.json) as text, so the policy stays hashable; `get` parses once."""

    tables: tuple[tuple[str, str], ...]

    @classmethod
    def from_files(cls, **overrides: dict) -> Tuning:
        """The op folders' tuning.json files, with whole tables replaced by `overrides` (op name -> dict)."""
        root = pathlib.Path(__file__).parent
        tables = {
            op: (root / op / "tuning.json").read_text() for op in TUNED_OPS if (root / op / "tuning.json").exists()
        }
        tables.update({op: json.dumps(t) for op, t in overrides.items()})
        return cls(tuple(sorted(tables.items())))

    def with_entries(self, op: str, **entries) -> Tuning:
        """This tuning with `entries` set in op's table, every other entry and table as it is (a run that tries a
        setting without changing the tuning.json default, e.g. bench/rank_slice.py --mix-norm-single-device)."""
        tables = dict(self.tables)
        tables[op] = json.dumps(dict(self.get(op), **entries))
        return Tuning(tuple(sorted(tables.items())))

    def get(self, op: str) -> dict:
        text = dict(self.tables).get(op)
        if text is None:
            raise KeyError(f"no tuning table for op {op!r} (have {[o for o, _ in self.tables]})")
        return _parse(text)


@functools.cache
def default_tuning() -> Tuning:
    return Tuning.from_files()


@dataclasses.dataclass(frozen=True)
class DecodePolicy:
    backend: str = "auto"
    moe_impl: str = "packed"
    fused_projection: bool = False  # the fused row-parallel projection + all-reduce (correct, measured slower)
    tuning: Tuning = dataclasses.field(default_factory=default_tuning)
    # the routed experts' largest E8M0 scale byte, where the weights were looked at (k3jax.layers.moe's
    # expert_scale_max; SCALE_MAX_UNKNOWN: not known): their kernels fold 2^126 into the scale only where every
    # byte allows it (the moe launch's scale_fold)
    expert_scale_max: int = SCALE_MAX_UNKNOWN

    def __post_init__(self):
        backend = BACKEND_ALIASES.get(self.backend, self.backend)
        if backend not in BACKENDS:
            raise ValueError(f"decode backend must be one of {BACKENDS}, got {self.backend!r}")
        object.__setattr__(self, "backend", backend)
        if self.moe_impl not in MOE_IMPLS:
            raise ValueError(f"moe_impl must be one of {MOE_IMPLS}, got {self.moe_impl!r}")

    @property
    def kernels(self) -> bool:
        """Whether Pallas kernels are asked for (each may still refuse a call)."""
        return self.backend == "latency_specialized"

    def table(self, op: str) -> dict:
        return self.tuning.get(op)

    def replace(self, **changes) -> DecodePolicy:
        return dataclasses.replace(self, **changes)


XLA = DecodePolicy()
SPECIALIZED = DecodePolicy("latency_specialized")


def as_policy(policy: DecodePolicy | str | None) -> DecodePolicy:
    """A policy from a policy, a backend name, or None (the default: stock XLA)."""
    if policy is None:
        return XLA
    if isinstance(policy, str):
        return DecodePolicy(policy)
    if not isinstance(policy, DecodePolicy):
        raise TypeError(f"expected a DecodePolicy or a backend name, got {type(policy).__name__}")
    return policy


# ---------------------------------------------------------------------------------------- what ran, and why
@dataclasses.dataclass
class DispatchLog:
    """op -> {"impl": "pallas" | "xla", "reason": why not the kernel (None where it ran)}, filled while tracing."""

    ops: dict[str, dict] = dataclasses.field(default_factory=dict)

    def record(self, op: str, impl: str, reason: str | None) -> None:
        self.ops[op] = {"impl": impl, "reason": reason}


_active: list[DispatchLog] = []


@contextlib.contextmanager
def recording(log: DispatchLog) -> Iterator[DispatchLog]:
    """Record every dispatch traced inside the block into `log`."""
    _active.append(log)
    try:
        yield log
    finally:
        _active.remove(log)


def record(op: str, impl: str, reason: str | None = None) -> None:
    for log in _active:
        log.record(op, impl, reason)


def dispatch(op: str, policy: DecodePolicy, kernel: Callable[[], object], reference: Callable[[], object]):
    """kernel() where the policy asks for kernels and it takes the call, else reference(); recorded, and a
    refusal logged once."""
    if policy.kernels:
        try:
            out = kernel()
        except NotImplementedError as e:
            from pallas_kernels import common  # jax: kept off the import of this module (the CLI's --help)

            common.log_once(op, str(e))
            record(op, "xla", str(e))
        else:
            record(op, "pallas")
            return out
    else:
        record(op, "xla", f"decode backend {policy.backend}")
    return reference()
