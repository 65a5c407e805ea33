"""``horovod.runner.util``: the helpers Horovod's tests import."""
