"""dp_plugin.torch: a drop-in for ``horovod.torch`` on PyTorch 2.x."""
