"""A run's training losses as TensorBoard recorded them."""

import os

import numpy as np


def losses(workdir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(os.path.join(workdir, "tb"))
    ea.Reload()
    return np.array([e.value for e in ea.Scalars("train/loss")])
