"""Local WAN emulation: shaped links between regions (latency, bandwidth, jitter, loss, outages, schedules)."""

from .config import EmulationConfig, LinkSpec, ScheduleEvent
from .emulator import WanEmulator
from .presets import Preset, load_preset, preset_names

__all__ = ["EmulationConfig", "LinkSpec", "ScheduleEvent", "WanEmulator", "Preset", "load_preset", "preset_names"]
