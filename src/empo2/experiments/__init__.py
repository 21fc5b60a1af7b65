"""Experiment drivers built on training runs: ``compare`` (several runs side by side), ``adapt`` (memory-only OOD
adaptation and the Reflexion baseline) and ``report`` (the paper's tables from run folders)."""
