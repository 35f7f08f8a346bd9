"""Prints every scalar of a TensorBoard log directory as JSON, {tag: [[step, value], ...]},
read by TensorBoard's own EventAccumulator (what the TensorBoard UI shows)."""
import json
import sys

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0})
acc.Reload()
print(json.dumps({tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}))
