"""Vision adapter: the text-side loss classes in SimCLR's NT-Xent layout (:mod:`.objectives`).

Import from the submodule (it imports sentence-transformers). The recipe, with its datasets, augmentations, CIFAR
ResNets and probes, is ``recipes/simclr.py`` (its apparatus: ``recipes/simclr_tools/``); see docs/vision.md.
"""
