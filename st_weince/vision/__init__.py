"""Vision adapter: SimCLR-style training of image encoders with the same loss classes as the text side.

- :mod:`.data`: CIFAR-10/100 and STL-10 (torchvision, or an ImageFolder directory or zip) as uint8 tensors;
- :mod:`.augment`: SimCLR's augmentations, batched on tensors, with their own generator;
- :mod:`.models`: CIFAR-stem ResNets and the projection head;
- :mod:`.objectives`: the NT-Xent layout over the shared loss classes (InfoNCE, WEINCE, RB-Sigmoid);
- :mod:`.setups`: the released and the batchnorm-head setups;
- :mod:`.training`: one training step and epoch;
- :mod:`.evaluation`: frozen-feature probes (k-NN, linear).

Import from the submodules (the objectives import sentence-transformers, which the others need not pay for). The
recipe is ``recipes/simclr.py``; see docs/vision.md.
"""
