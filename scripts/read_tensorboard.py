#!/usr/bin/env python3
"""Reads TensorBoard event files with the tensorboard package's strict record reader (it raises on a bad
CRC) and prints {tag: {step: value}} as JSON.

    python3 scripts/read_tensorboard.py RUN_DIR/tb
"""
import glob
import json
import os
import sys

from tensorboard.compat.proto import event_pb2
from tensorboard.compat.tensorflow_stub.errors import OutOfRangeError
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import PyRecordReader_New


def main():
    scalars, version = {}, None
    for path in sorted(glob.glob(os.path.join(sys.argv[1], "events.out.tfevents.*"))):
        reader = PyRecordReader_New(path)
        while True:
            try:
                reader.GetNext()
            except OutOfRangeError:  # the end; a bad CRC raises DataLossError instead
                break
            e = event_pb2.Event()
            e.ParseFromString(reader.record())
            if e.HasField("file_version"):
                version = e.file_version
            for v in e.summary.value:
                scalars.setdefault(v.tag, {})[str(e.step)] = v.simple_value
    print(json.dumps({"file_version": version, "scalars": scalars}))


if __name__ == "__main__":
    main()
