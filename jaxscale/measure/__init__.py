"""Measurement: FLOPs, HLO reading, memory, peaks, timing, profiling, traces and the row's measured columns.

The lowest floor of the package: nothing here imports the model, training, planning, run or sweep code.
"""
