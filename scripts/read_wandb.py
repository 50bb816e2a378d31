#!/usr/bin/env python3
"""Reads a W&B offline run file (run-<id>.wandb) with wandb's own protobuf classes and prints a JSON
summary: config, history steps and their keys, the last summary, the exit code. The framing is parsed
here (32 KiB blocks, CRC-32 checked on every chunk) so that any wandb version can decode the records.

    python3 scripts/read_wandb.py PATH/run-<id>.wandb
"""
import json
import struct
import sys
import zlib

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768


def records(data):
    assert data[:7] == b":W&B" + struct.pack("<H", 0xBEE1) + b"\x00", "bad header"
    pos, cur = 7, b""
    while pos < len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:
            assert data[pos:pos + left] == b"\x00" * left
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        payload = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + payload) == crc, f"bad crc at {pos}"
        cur += payload
        if kind in (1, 4):
            r = pb.Record()
            r.ParseFromString(cur)
            yield r
            cur = b""
        pos += 7 + length


def main():
    out = {"config": {}, "history": [], "summary": {}, "exit_code": None, "run_id": None, "order": []}
    for r in records(open(sys.argv[1], "rb").read()):
        kind = r.WhichOneof("record_type")
        out["order"].append(kind)
        if kind == "run":
            out["run_id"] = r.run.run_id
            out["project"] = r.run.project
            out["config"] = {i.key: json.loads(i.value_json) for i in r.run.config.update}
        elif kind == "history":
            out["history"].append({i.key: json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            out["summary"] = {i.key: json.loads(i.value_json) for i in r.summary.update}
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    print(json.dumps(out))


if __name__ == "__main__":
    main()
