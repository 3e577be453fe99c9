"""sentence-transformers loss classes: thin adapters over :mod:`st_weince.functional`, each reading one frozen options
object (:class:`~st_weince.functional.WEINCEOptions`, :class:`~st_weince.functional.RBSigmoidOptions`)."""

from st_weince.losses.cached_rb_sigmoid import CachedRBSigmoidLoss
from st_weince.losses.cached_weince import CachedWEINCELoss
from st_weince.losses.rb_sigmoid import RBSigmoidLoss
from st_weince.losses.weince import WEINCELoss

__all__ = ["CachedRBSigmoidLoss", "CachedWEINCELoss", "RBSigmoidLoss", "WEINCELoss"]
