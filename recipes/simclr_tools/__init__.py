"""The SimCLR recipe's apparatus (recipes/simclr.py, and the SimCLR studies in benchmarks/): not part of the wheel.

- :mod:`.data`: CIFAR-10/100 and STL-10 (torchvision, or an ImageFolder directory or zip) as uint8 tensors;
- :mod:`.augment`: SimCLR's augmentations, batched on tensors, with their own generator;
- :mod:`.models`: CIFAR-stem ResNets and the projection head, saved and loaded as encoder folders;
- :mod:`.setups`: the released and the batchnorm-head setups;
- :mod:`.training`: one training step and epoch;
- :mod:`.evaluation`: frozen-feature probes (k-NN, linear).

The losses come from the package (``st_weince.vision.objectives``: the loss classes in SimCLR's layout). A script in
recipes/ imports this folder by its plain name (Python puts the script's folder on ``sys.path``); benchmarks/lab puts
recipes/ on the path for the studies. Needs torchvision (``pip install "st-weince[vision]"``).
"""
