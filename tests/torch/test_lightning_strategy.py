"""dp_plugin.lightning without processes: registration and argument checks.

The strategy in real processes is tests/multiproc/test_lightning.py.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lightning", reason="needs the lightning extra: pip install "
                                        "'dp_plugin[lightning]'")

import lightning.pytorch as lp
import pytorch_lightning as pl
import torch

import dp_plugin.lightning as dpl
from dp_plugin.lightning.collectives import _check_group, _reduce_op
from dp_plugin.torch import Average, Max, Sum


@pytest.mark.parametrize("name", ["horovod", "dp_plugin"])
def test_both_names_are_registered_for_both_lightning_packages(name: str) -> None:
    assert isinstance(lp.strategies.StrategyRegistry.get(name), dpl.HorovodStrategy)
    assert isinstance(lp.strategies.StrategyRegistry.get(name), lp.strategies.ParallelStrategy)
    assert isinstance(pl.strategies.StrategyRegistry.get(name), dpl.PLHorovodStrategy)
    assert isinstance(pl.strategies.StrategyRegistry.get(name), pl.strategies.ParallelStrategy)


def test_unknown_keyword_names_what_is_passed_on() -> None:
    with pytest.raises(TypeError, match=r"\['backward_passes_per_step'\].*only \['compression'"):
        dpl.HorovodStrategy(backward_passes_per_step=2)
    assert dpl.HorovodStrategy(op=Sum)._optimizer_options == {"op": Sum}


def test_reduce_ops_by_name_and_torch_enum() -> None:
    who = "HorovodStrategy.reduce"
    assert _reduce_op(None, who) is Average and _reduce_op("mean", who) is Average
    assert _reduce_op(torch.distributed.ReduceOp.SUM, who) is Sum
    assert _reduce_op("max", who) is Max
    with pytest.raises(ValueError, match=r"reduce: reduce_op='median' is not supported; use one"):
        _reduce_op("median", who)
    with pytest.raises(ValueError, match=r"group=.* is not supported; it runs over every rank"):
        _check_group(object(), who)
    _check_group(None, who)  # every rank; Fabric passes torch's WORLD, also every rank
