"""The machine as gptopt runs on it: the device and its autocast policy (device.py), memory free and the check
against an estimate (memory_check.py), the monitor, torch.compile's options (compile.py), the process-wide switches a
command sets where it starts (process.py), stop signals (signals.py), and every private torch API, wrapped once
(torch_private.py).
"""
