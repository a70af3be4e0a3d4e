"""Configuration: one frozen dataclass, read from the environment once.

``Config.from_env()`` is the only place that reads ``DP_PLUGIN_*`` (and the
Horovod names we honour); everything else receives a ``Config``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from dp_plugin.errors import ConfigError
from dp_plugin.validate import (
    check_choice,
    check_int,
    check_positive_float,
    env_bool,
    env_choice,
    env_int,
    env_int_list,
    env_positive_float,
)

EngineName = Literal["auto", "horovod", "gloo", "nccl", "mpi", "local"]
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)
CheckFinite = Literal["off", "skip", "raise"]
CHECK_FINITE_MODES: tuple[str, ...] = get_args(CheckFinite)

DEFAULT_FUSION_THRESHOLD = 25 * 1024 * 1024
"""25 MiB, PyTorch DDP's default bucket: few collectives, yet several per step for
models of tens of MB, so communication overlaps backward (BENCHMARKS.md)."""
DEFAULT_FIRST_BUCKET_THRESHOLD = 1024 * 1024
"""1 MiB, DDP's first bucket: the first gradients of backward start travelling early."""
DEFAULT_MIN_BUCKETS = 4
"""A gradient smaller than 4 buckets of the default size is spread over about 4:
the first three then travel while backward still runs, as they do for large
models, at the same step time (measured: docs/benchmarks-history.md, "Where
every goal stands (2026-12-01, fourth session)")."""
MAX_MIN_BUCKETS = 1024
DEFAULT_TIMEOUT_S = 1800.0
"""30 minutes, torch.distributed's default for gloo: a rank-0-only evaluation or
checkpoint between steps must not kill the job (docs/configuration.md)."""
DEFAULT_STALL_WARNING_S = 60.0
"""A minute, Horovod's stall inspector's default: a rank waiting this long in one
collective warns, and again every minute, naming the ranks not yet there."""
MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""A week: longer is no timeout at all (and overflows some engines' clocks)."""
MIN_SECRET = 16
"""Shortest accepted DP_PLUGIN_JOB_SECRET (characters)."""

DEFAULT_TIMELINE_MAX_BYTES = 1 << 30
"""1 GiB of events per rank's trace file: hours of steps, and still loadable in Perfetto."""

MAX_THRESHOLD = 1 << 40
"""1 TiB: no fusion buffer is bigger; a larger value is a typo."""

DEFAULT_AUTOTUNE_CANDIDATES = tuple(m << 20 for m in (1, 4, 8, 25, 64))
"""Bucket sizes autotune tries (1, 4, 8, 25, 64 MiB), plus the configured one."""
MAX_AUTOTUNE_CANDIDATES = 16
MAX_AUTOTUNE_STEPS = 1000
"""Most warm-up or timed steps per candidate: more is a typo, not a measurement."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Settings of the core. Build with ``Config.from_env()`` or directly."""

    engine: EngineName = "auto"
    """Collective engine; ``auto`` picks one for the launcher and device."""

    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    """Largest fusion buffer in bytes (a bigger tensor gets a bucket of its own)."""

    first_bucket_threshold: int | None = DEFAULT_FIRST_BUCKET_THRESHOLD
    """Cap of the gradient scheduler's first bucket (the smaller of this and
    ``fusion_threshold`` applies); None: as large as the others. ``from_env``
    sets None when the user sets a fusion threshold (as DDP with ``bucket_cap_mb``)."""

    min_buckets: int = DEFAULT_MIN_BUCKETS
    """How many buckets the default plan spreads a small gradient over: the cap
    becomes 1/min_buckets of the gradient's bytes where that is below
    ``fusion_threshold`` (never below ``first_bucket_threshold``); 1: no
    spreading. ``from_env`` sets 1 when the user sets a fusion threshold."""

    gradient_as_bucket_view: bool = True
    """``DistributedOptimizer`` makes ``.grad`` a view of the fusion buffer (no copies)."""

    timeline: str | None = None
    """Chrome-trace output path; ``{rank}`` is replaced, else ``.rankN`` is inserted."""

    timeline_max_bytes: int = DEFAULT_TIMELINE_MAX_BYTES
    """Largest size of a rank's trace file in bytes (0: no limit); later events are dropped."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds a collective may take before it raises instead of hanging."""

    stall_warning_s: float = DEFAULT_STALL_WARNING_S
    """Seconds between the warnings a rank logs while it waits in one collective,
    naming the ranks not yet there (as Horovod's stall inspector); 0: none.
    The wait still ends at ``timeout_s``."""

    shared_memory: bool = True
    """The gloo engine all-reduces through a shared-memory segment when every
    rank of the job is on one host (``engines/shm.py``); False: Gloo's TCP."""

    shared_memory_budget: int | None = None
    """Bytes of shared memory all of a process's segments may take (each
    engine and optimizer channel has one); None: a quarter of ``/dev/shm``'s
    size. Within it the chunk shrinks; below the smallest segment the gloo
    engine keeps Gloo's TCP and says so once in the log."""

    hierarchical_allreduce: bool | None = None
    """The gloo engine's all-reduce on several hosts with several ranks each:
    True reduces inside each host through shared memory and across hosts
    between the ranks of the same local rank (``engines/hierarchical.py``);
    False: one flat Gloo ring over every rank; None: hierarchical where the
    launcher's topology has more than one host and more than one rank per
    host, the same number on each."""

    rebuild_buckets: bool = True
    """Re-plan buckets from the gradient ready order observed in the first step."""

    check_finite: CheckFinite = "off"
    """After the gradient all-reduce: ``skip`` the step or ``raise`` on inf/nan."""

    shard_optimizer_state: bool = False
    """``DistributedOptimizer`` keeps the optimizer state of 1/size of the
    parameters per rank (ZeRO stage 1) where its ``shard_optimizer_state``
    argument is not given (docs/torch.md, "Sharded optimizer state")."""

    autotune: bool = False
    """Measure the candidate bucket sizes during the first steps and keep the fastest
    (``DistributedOptimizer``; see docs/configuration.md, "Autotune")."""

    autotune_warmup_steps: int = 2
    """Steps dropped after each switch of bucket size before timing starts."""

    autotune_steps: int = 5
    """Steps timed per candidate bucket size (their median is compared)."""

    autotune_candidates: tuple[int, ...] = DEFAULT_AUTOTUNE_CANDIDATES
    """Bucket sizes (bytes) autotune tries, besides ``fusion_threshold``."""

    process_sets: bool = False
    """The program asked for process sets at ``init(process_sets=...)``. Only the
    horovod engine needs to know before it starts: it then enables Horovod's
    dynamic process sets, which cost a check in every background cycle. Other
    engines can always add sets."""

    job_secret: str | None = field(default=None, repr=False)
    """Signs rank 0's store address in Horovod's rendezvous server (never
    printed); from DP_PLUGIN_JOB_SECRET_FILE (preferred: off command lines)
    or DP_PLUGIN_JOB_SECRET."""

    def __post_init__(self) -> None:
        error = ConfigError
        check_choice("engine", self.engine, ENGINE_NAMES, kind="engines",
                     fix="set DP_PLUGIN_ENGINE to one of them", error=error)
        check_int(
            "fusion_threshold (bytes)", self.fusion_threshold, minimum=1,
            fix=f"use e.g. {DEFAULT_FUSION_THRESHOLD} (25 MiB), or 1 for one tensor per bucket",
            error=error,
        )
        if self.fusion_threshold > MAX_THRESHOLD:
            raise error(f"fusion_threshold (bytes) must be <= {MAX_THRESHOLD} (1 TiB), got "
                        f"{self.fusion_threshold!r}; use e.g. {DEFAULT_FUSION_THRESHOLD} (25 MiB)")
        if self.first_bucket_threshold is not None:
            check_int("first_bucket_threshold (bytes)", self.first_bucket_threshold, minimum=1,
                      fix=f"use e.g. {DEFAULT_FIRST_BUCKET_THRESHOLD} (1 MiB), or None for a "
                          "first bucket as large as the others", error=error)
        check_int("min_buckets", self.min_buckets, minimum=1, maximum=MAX_MIN_BUCKETS,
                  fix=f"set DP_PLUGIN_MIN_BUCKETS to e.g. {DEFAULT_MIN_BUCKETS}, or 1 to keep "
                      "the buckets at the fusion threshold", error=error)
        for flag in ("gradient_as_bucket_view", "rebuild_buckets", "process_sets", "autotune",
                     "shard_optimizer_state"):
            if not isinstance(getattr(self, flag), bool):
                raise error(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.hierarchical_allreduce not in (None, True, False):
            raise error(f"hierarchical_allreduce must be None (automatic), True or False, got "
                        f"{self.hierarchical_allreduce!r}")
        if self.shared_memory_budget is not None:
            check_int("shared_memory_budget (bytes)", self.shared_memory_budget, minimum=0,
                      maximum=MAX_THRESHOLD, fix="set DP_PLUGIN_SHARED_MEMORY_BUDGET to a number "
                      "of bytes, or leave it unset for a quarter of /dev/shm", error=error)
        if self.timeline is not None and (
                not isinstance(self.timeline, str) or not self.timeline or "\x00" in self.timeline):
            raise error(f"timeline must be None or a non-empty file path without NUL "
                        f"characters, got {self.timeline!r}; set DP_PLUGIN_TIMELINE to a path")
        check_int("timeline_max_bytes", self.timeline_max_bytes, minimum=0,
                  fix=f"set DP_PLUGIN_TIMELINE_MAX_BYTES to a number of bytes (default "
                      f"{DEFAULT_TIMELINE_MAX_BYTES}, i.e. 1 GiB), or 0 for no limit", error=error)
        # Finite: an infinite timeout is a hang, and timedelta(seconds=inf) overflows.
        check_positive_float("timeout_s", self.timeout_s, unit="seconds", maximum=MAX_TIMEOUT_S,
                             fix=f"the default is {DEFAULT_TIMEOUT_S:g}", error=error)
        if self.stall_warning_s != 0:
            check_positive_float("stall_warning_s", self.stall_warning_s, unit="seconds",
                                 maximum=MAX_TIMEOUT_S, fix=f"the default is "
                                 f"{DEFAULT_STALL_WARNING_S:g}; 0 turns the warning off",
                                 error=error)
        check_int("autotune_warmup_steps", self.autotune_warmup_steps, minimum=0,
                  maximum=MAX_AUTOTUNE_STEPS, fix="set DP_PLUGIN_AUTOTUNE_WARMUP_STEPS (default 2)",
                  error=error)
        check_int("autotune_steps", self.autotune_steps, minimum=1, maximum=MAX_AUTOTUNE_STEPS,
                  fix="set DP_PLUGIN_AUTOTUNE_STEPS (default 5)", error=error)
        cands = self.autotune_candidates
        fix = ("set DP_PLUGIN_AUTOTUNE_CANDIDATES to a comma-separated list of bytes, e.g. "
               "1048576,8388608,26214400")
        if not isinstance(cands, tuple) or not 1 <= len(cands) <= MAX_AUTOTUNE_CANDIDATES:
            raise error(f"autotune_candidates must be a tuple of 1 to {MAX_AUTOTUNE_CANDIDATES} "
                        f"ints, got {cands!r}; {fix}")
        for c in cands:
            check_int("autotune_candidates (bytes)", c, minimum=1, maximum=MAX_THRESHOLD, fix=fix,
                      error=error)
        check_choice("check_finite", self.check_finite, CHECK_FINITE_MODES, kind="modes",
                     fix="set DP_PLUGIN_CHECK_FINITE to one of them", error=error)
        secret = self.job_secret
        if secret is not None and (not isinstance(secret, str) or len(secret) < MIN_SECRET
                                   or not secret.isascii() or not secret.isprintable()
                                   or any(c.isspace() for c in secret)):
            length = len(secret) if isinstance(secret, str) else type(secret).__name__
            raise error(  # the value itself is never printed
                f"DP_PLUGIN_JOB_SECRET must be at least {MIN_SECRET} printable ASCII characters "
                f"without spaces (got {length} characters); use e.g. "
                "DP_PLUGIN_JOB_SECRET=$(openssl rand -hex 16), the same on every rank"
            )

    def bucket_caps(self, fusion_threshold: int | None = None,
                    total_bytes: int = 0) -> tuple[int, int | None]:
        """(bucket cap, first bucket cap) in bytes for a gradient of
        ``total_bytes``: a caller's explicit ``fusion_threshold`` applies to
        every bucket; the configured one comes with the configured (small)
        first bucket, and shrinks to spread a small gradient over
        ``min_buckets`` buckets."""
        if fusion_threshold is not None:
            return fusion_threshold, None
        cap, first = self.fusion_threshold, self.first_bucket_threshold
        if self.min_buckets > 1 and total_bytes > 0:
            cap = min(cap, max(-(-total_bytes // self.min_buckets), first or 1))
        return cap, first

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Read the configuration from ``env`` (default: ``os.environ``).

        Plugin names win over Horovod's where both are set.
        ``HOROVOD_FUSION_THRESHOLD=0`` means "no fusion" in Horovod and maps
        to a 1-byte threshold (one tensor per bucket).
        """
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}
        if "DP_PLUGIN_ENGINE" in env:
            kwargs["engine"] = env_choice(env, "DP_PLUGIN_ENGINE", ENGINE_NAMES, kind="engine",
                                          error=ConfigError)
        threshold = _fusion_threshold(env)
        if threshold is not None:
            kwargs["fusion_threshold"] = threshold
        for name, key, minimum, maximum, unit, fix in _INT_VARIABLES:
            if name in env:
                kwargs[key] = env_int(env, name, minimum=minimum, maximum=maximum, unit=unit,
                                      fix=fix, error=ConfigError)
        if "fusion_threshold" in kwargs:  # the user's size, for every bucket (as DDP)
            kwargs["first_bucket_threshold"] = None
            kwargs.setdefault("min_buckets", 1)
        timeline = next((n for n in ("DP_PLUGIN_TIMELINE", "HOROVOD_TIMELINE") if env.get(n)), None)
        if timeline is not None:
            if "\x00" in env[timeline]:
                raise ConfigError(f"{timeline}={env[timeline]!r} holds a NUL character; set it to "
                                  "a file path (or empty for no timeline)")
            kwargs["timeline"] = env[timeline]
        if "DP_PLUGIN_TIMEOUT" in env:
            kwargs["timeout_s"] = env_positive_float(
                env, "DP_PLUGIN_TIMEOUT", unit="seconds", maximum=MAX_TIMEOUT_S,
                fix=f"default {DEFAULT_TIMEOUT_S:g}", error=ConfigError,
            )
        stall = "DP_PLUGIN_STALL_WARNING_SECONDS"
        if env.get(stall, "").strip() in ("0", "0.0"):
            kwargs["stall_warning_s"] = 0.0  # off
        elif stall in env:
            kwargs["stall_warning_s"] = env_positive_float(
                env, stall, unit="seconds", maximum=MAX_TIMEOUT_S,
                fix=f"the default is {DEFAULT_STALL_WARNING_S:g}; 0 turns the warning off",
                error=ConfigError)
        for name, key in _BOOL_VARIABLES:
            if name in env:
                kwargs[key] = env_bool(env, name, error=ConfigError)
        # Horovod's HOROVOD_HIERARCHICAL_ALLREDUCE is honoured as the same switch; ours
        # wins where it is set to something (an empty value counts as unset).
        for name in ("DP_PLUGIN_HIERARCHICAL_ALLREDUCE", "HOROVOD_HIERARCHICAL_ALLREDUCE"):
            if env.get(name, "").strip():
                kwargs["hierarchical_allreduce"] = env_bool(env, name, error=ConfigError)
                break
        if "DP_PLUGIN_CHECK_FINITE" in env:
            kwargs["check_finite"] = env_choice(
                env, "DP_PLUGIN_CHECK_FINITE", CHECK_FINITE_MODES, kind="mode",
                fix="'skip' skips a step whose reduced gradients hold inf or nan, 'raise' "
                    "raises; the default is off", error=ConfigError,
            )
        if "DP_PLUGIN_AUTOTUNE_CANDIDATES" in env:
            kwargs["autotune_candidates"] = tuple(env_int_list(
                env, "DP_PLUGIN_AUTOTUNE_CANDIDATES", minimum=1, maximum=MAX_THRESHOLD,
                max_items=MAX_AUTOTUNE_CANDIDATES, unit="bytes",
                fix="e.g. 1048576,8388608,26214400 (1, 8 and 25 MiB)", error=ConfigError))
        if kwargs.get("autotune") and "fusion_threshold" in kwargs:
            name = next(n for n in ("DP_PLUGIN_FUSION_THRESHOLD", "HOROVOD_FUSION_THRESHOLD")
                        if n in env)
            warnings.warn(
                f"DP_PLUGIN_AUTOTUNE=1 and {name}={env[name]!r} are both set: autotune "
                f"measures {name} among its candidate bucket sizes and keeps the fastest, "
                f"which may be another one; unset DP_PLUGIN_AUTOTUNE to keep {name} as set",
                UserWarning, stacklevel=2)
        kwargs.update(_job_secret(env))
        return cls(**kwargs)  # type: ignore[arg-type]


_INT_VARIABLES: tuple[tuple[str, str, int, int | None, str, str], ...] = (
    # (variable, Config field, minimum, maximum, unit, fix)
    ("DP_PLUGIN_MIN_BUCKETS", "min_buckets", 1, MAX_MIN_BUCKETS, "buckets",
     f"set e.g. {DEFAULT_MIN_BUCKETS}, or 1 to keep the buckets at the fusion threshold"),
    ("DP_PLUGIN_SHARED_MEMORY_BUDGET", "shared_memory_budget", 0, MAX_THRESHOLD, "bytes",
     "the default (unset) is a quarter of /dev/shm; 0 keeps Gloo's TCP"),
    ("DP_PLUGIN_TIMELINE_MAX_BYTES", "timeline_max_bytes", 0, None, "bytes",
     f"default {DEFAULT_TIMELINE_MAX_BYTES} (1 GiB); 0 means no limit"),
    ("DP_PLUGIN_AUTOTUNE_WARMUP_STEPS", "autotune_warmup_steps", 0, MAX_AUTOTUNE_STEPS, "steps",
     "the default is 2"),
    ("DP_PLUGIN_AUTOTUNE_STEPS", "autotune_steps", 1, MAX_AUTOTUNE_STEPS, "steps",
     "the default is 5"),
)
_BOOL_VARIABLES: tuple[tuple[str, str], ...] = (
    ("DP_PLUGIN_SHARED_MEMORY", "shared_memory"),
    ("DP_PLUGIN_REBUILD_BUCKETS", "rebuild_buckets"),
    ("DP_PLUGIN_GRADIENT_AS_BUCKET_VIEW", "gradient_as_bucket_view"),
    ("DP_PLUGIN_AUTOTUNE", "autotune"),
    ("DP_PLUGIN_SHARD_OPTIMIZER_STATE", "shard_optimizer_state"),
)


def _fusion_threshold(env: Mapping[str, str]) -> int | None:
    """The fusion threshold the user set (ours over Horovod's), or None."""
    fusion = f"(default {DEFAULT_FUSION_THRESHOLD}, i.e. 25 MiB)"
    if "DP_PLUGIN_FUSION_THRESHOLD" in env:
        return env_int(
            env, "DP_PLUGIN_FUSION_THRESHOLD", minimum=1, maximum=MAX_THRESHOLD, unit="bytes",
            fix=f"set a positive number of bytes {fusion}", error=ConfigError,
        )
    if "HOROVOD_FUSION_THRESHOLD" in env:  # 0: Horovod's "no fusion" (from_env's docstring)
        value = env_int(
            env, "HOROVOD_FUSION_THRESHOLD", minimum=0, maximum=MAX_THRESHOLD, unit="bytes",
            fix=f"set 0 (no fusion) or a positive number of bytes {fusion}", error=ConfigError,
        )
        return 1 if value == 0 else value
    return None


def _job_secret(env: Mapping[str, str]) -> dict[str, object]:
    """``job_secret`` from DP_PLUGIN_JOB_SECRET_FILE (read here, at init) or
    DP_PLUGIN_JOB_SECRET. The file keeps the secret off every command line:
    horovodrun starts its workers as ``env K=V ... python``, which ``ps``
    shows on every host for the whole job."""
    path = env.get("DP_PLUGIN_JOB_SECRET_FILE")
    if not path:
        return {"job_secret": env["DP_PLUGIN_JOB_SECRET"]} if "DP_PLUGIN_JOB_SECRET" in env else {}
    if "DP_PLUGIN_JOB_SECRET" in env:
        raise ConfigError("both DP_PLUGIN_JOB_SECRET and DP_PLUGIN_JOB_SECRET_FILE are set; "
                          "keep DP_PLUGIN_JOB_SECRET_FILE alone (it stays off command lines)")
    try:
        with open(path, encoding="ascii") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"DP_PLUGIN_JOB_SECRET_FILE={path!r} cannot be read ({exc}); give a "
                          "file holding the secret, readable by this user on every host") from None
    if mode & 0o077:
        raise ConfigError(f"DP_PLUGIN_JOB_SECRET_FILE={path!r} has mode {mode & 0o777:o}: other "
                          f"users may read the secret; `chmod 600 {path}`")
    return {"job_secret": secret}

