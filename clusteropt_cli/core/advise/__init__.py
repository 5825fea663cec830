"""copt advise core: memory and time models, the decision matrix, recipe/DeepSpeed config emission.

Modules: calibration (every tunable constant), plan (inputs + validation), memory, timing, recommend,
api (the `advise()` entry point and emitters), measure (the CPU memory quantity measured on a real model).
"""
