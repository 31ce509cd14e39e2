"""Test support that ships with the package: the NVML capture replay."""

from __future__ import annotations

from gpuwatchd.testing.replay import ReplayClient, Step, expand_devices, load_capture

__all__ = ["ReplayClient", "Step", "expand_devices", "load_capture"]
