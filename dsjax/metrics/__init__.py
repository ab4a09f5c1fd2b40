"""What a run measures and reports: model FLOPs and MFU (flops), the writers (writers),
collectives in compiled HLO (hlo), the communication share from a profiler trace (trace), and
memory (memory). docs/observability.md says what each number means."""

from dsjax.metrics.flops import (PEAK_BF16, cost_per_million_tokens, flops_per_token,
                                 matmul_params, measured_cpu_matmul_rate, peak_flops_per_device,
                                 vision_flops_per_image)
from dsjax.metrics.hlo import (Collective, axis_collectives, collective_bytes, hlo_collectives,
                               looped_axis_bytes, looped_axis_traffic)
from dsjax.metrics.memory import (device_memory_bytes, device_utilisation, energy_joules,
                                  fit_capacity, format_bytes, memory_reading, memory_stats,
                                  predicted_bytes)
from dsjax.metrics.writers import MetricsWriter, format_duration, log, median_of, update_summary

__all__ = ["PEAK_BF16", "Collective", "MetricsWriter", "axis_collectives", "collective_bytes",
           "cost_per_million_tokens", "device_memory_bytes", "device_utilisation",
           "energy_joules", "fit_capacity", "flops_per_token",
           "format_bytes", "format_duration", "hlo_collectives", "log", "looped_axis_bytes",
           "looped_axis_traffic", "matmul_params",
           "measured_cpu_matmul_rate", "median_of", "memory_reading", "memory_stats",
           "peak_flops_per_device", "predicted_bytes", "update_summary", "vision_flops_per_image"]
