"""Where an emulated run stops being what it claims: one definition for the run's own
flags (backend.fidelity_summary), the worker's lateness count, the fidelity monitor and
the figure-level fidelity table (analysis/fidelity.py). Imports nothing, so analysis can
read it without loading the emulator."""

RATE_READBACK_REL = 0.02  # an HTB class's read-back rate within 2% of the configured B/T
RELEASE_LATE_REL = 0.05  # a stream release later than 5% of its modeled service is late
CPU_SATURATED_PCT = 95.0  # a one-second host CPU sample at or above this is saturation
#: steps whose real kernels outlast their padding that are still host noise (a kernel
#: preempted now and then); a worker is flagged above this and above 1% of its steps
KERNEL_OVER_NOISE = 2
#: jobs that reached a stream after the step they had arrived for (model time) started, as a
#: share of the worker's jobs, above which the run is flagged (each changes a step's batch)
MISSED_STEP_REL = 0.01
