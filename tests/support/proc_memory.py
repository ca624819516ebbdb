"""This process's resident memory as the kernel reports it (/proc/self/status), for the workers that measure what
loading a model costs a rank. Imported by the worker scripts as a sibling module (torchrun puts the script's folder
first on sys.path)."""

from __future__ import annotations


def rss_mib() -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (the peak resident so far), in MiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) / 1024
    return out
