"""st-weince: WEINCE and RB-Sigmoid contrastive losses for sentence-transformers."""

__version__ = "0.1.0"
