"""Configuration: one frozen dataclass, read from the environment once.

``Config.from_env()`` is the only place that reads ``DP_PLUGIN_*`` (and the
Horovod names we honour); everything else receives a ``Config``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, get_args

EngineName = Literal["auto", "horovod", "gloo", "nccl", "mpi", "local"]
ENGINE_NAMES: tuple[str, ...] = get_args(EngineName)

DEFAULT_FUSION_THRESHOLD = 64 * 1024 * 1024
DEFAULT_TIMEOUT_S = 300.0

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """Settings of the core. Build with ``Config.from_env()`` or directly."""

    engine: EngineName = "auto"
    """Collective engine; ``auto`` picks one for the launcher and device."""

    fusion_threshold: int = DEFAULT_FUSION_THRESHOLD
    """Largest fusion buffer in bytes (a bigger tensor gets a bucket of its own)."""

    timeline: str | None = None
    """Chrome-trace output path; ``{rank}`` is replaced, else ``.rankN`` is inserted."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    """Seconds a collective may take before it raises instead of hanging."""

    rebuild_buckets: bool = True
    """Re-plan buckets from the gradient ready order observed in the first step."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINE_NAMES:
            raise ValueError(
                f"engine {self.engine!r} is not known; valid engines: {', '.join(ENGINE_NAMES)} "
                "(set DP_PLUGIN_ENGINE to one of them)"
            )
        if isinstance(self.fusion_threshold, bool) or not isinstance(self.fusion_threshold, int):
            raise ValueError(
                f"fusion_threshold must be an int number of bytes, got {self.fusion_threshold!r}"
            )
        if self.fusion_threshold <= 0:
            raise ValueError(
                f"fusion_threshold must be > 0 bytes, got {self.fusion_threshold}; "
                f"use e.g. {DEFAULT_FUSION_THRESHOLD} (64 MiB), or 1 for one tensor per bucket"
            )
        if not self.timeout_s > 0:
            raise ValueError(
                f"timeout_s must be > 0 seconds, got {self.timeout_s!r}; "
                f"the default is {DEFAULT_TIMEOUT_S:g}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """Read the configuration from ``env`` (default: ``os.environ``).

        Plugin names win over Horovod's where both are set.
        ``HOROVOD_FUSION_THRESHOLD=0`` means "no fusion" in Horovod and maps
        to a 1-byte threshold (one tensor per bucket).
        """
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}

        engine = env.get("DP_PLUGIN_ENGINE")
        if engine is not None:
            engine = engine.strip().lower()
            if engine not in ENGINE_NAMES:
                raise ValueError(
                    f"DP_PLUGIN_ENGINE={env['DP_PLUGIN_ENGINE']!r} is not a known engine; "
                    f"valid values: {', '.join(ENGINE_NAMES)}"
                )
            kwargs["engine"] = engine

        if "DP_PLUGIN_FUSION_THRESHOLD" in env:
            kwargs["fusion_threshold"] = _int(env, "DP_PLUGIN_FUSION_THRESHOLD")
        elif "HOROVOD_FUSION_THRESHOLD" in env:
            value = _int(env, "HOROVOD_FUSION_THRESHOLD")
            kwargs["fusion_threshold"] = 1 if value == 0 else value
        if "fusion_threshold" in kwargs and int(kwargs["fusion_threshold"]) <= 0:  # type: ignore[call-overload]
            name = (
                "DP_PLUGIN_FUSION_THRESHOLD"
                if "DP_PLUGIN_FUSION_THRESHOLD" in env
                else "HOROVOD_FUSION_THRESHOLD"
            )
            raise ValueError(
                f"{name}={env[name]!r} must be a positive number of bytes "
                f"(default {DEFAULT_FUSION_THRESHOLD}, i.e. 64 MiB)"
            )

        timeline = env.get("DP_PLUGIN_TIMELINE") or env.get("HOROVOD_TIMELINE")
        if timeline:
            kwargs["timeline"] = timeline

        if "DP_PLUGIN_TIMEOUT" in env:
            raw = env["DP_PLUGIN_TIMEOUT"]
            try:
                timeout = float(raw)
            except ValueError:
                timeout = float("nan")
            if not timeout > 0:
                raise ValueError(
                    f"DP_PLUGIN_TIMEOUT={raw!r} must be a positive number of seconds "
                    f"(default {DEFAULT_TIMEOUT_S:g})"
                )
            kwargs["timeout_s"] = timeout

        if "DP_PLUGIN_REBUILD_BUCKETS" in env:
            kwargs["rebuild_buckets"] = _bool(env, "DP_PLUGIN_REBUILD_BUCKETS")

        return cls(**kwargs)  # type: ignore[arg-type]


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer number of bytes") from None


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = env[name].strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise ValueError(f"{name}={env[name]!r} is not a boolean; use 1/0, true/false, yes/no, on/off")
