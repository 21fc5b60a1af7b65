"""EMPO²: Exploratory Memory-Augmented On- and Off-Policy Optimization for LLM agents."""
__version__ = "0.1.0"
