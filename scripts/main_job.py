"""The platform's main job, as far as the platform exists: run by `make up` against the live stack.

Vision-inspection story, step 1: a plant's training output becomes a committed bundle, is pushed
to S3, pulled into a second plant's context, verified byte for byte, and the bundle events are
read back from Kafka with a plain consumer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from aiokafka import AIOKafkaConsumer
from opml.bundles.v1 import bundles_pb2 as pb

from opml_bundle_store.client import BundleStoreClient
from opml_common.errors import AlreadyExists
from opml_common.topics import BUNDLES

TARGET = os.environ.get("OPML_BUNDLE_STORE_TARGET", "127.0.0.1:50051")
REMOTE = os.environ.get("OPML_MAIN_JOB_REMOTE", "s3://opml-bundles/vision-inspection")


def ensure_context(client: BundleStoreClient, name: str) -> None:
    try:
        client.create_context(name, REMOTE)
    except AlreadyExists:
        client.set_remote(name, REMOTE)


def make_training_output(directory: Path) -> dict[str, Path]:
    """A stand-in training run's outputs: weights, a confusion matrix, and the training config."""
    weights = directory / "weights.bin"
    weights.write_bytes(random.Random(7).randbytes(4 * 64 * 64 * 3 * 8))
    confusion = directory / "confusion.json"
    confusion.write_text(json.dumps({"ok": {"ok": 912, "defect": 9}, "defect": {"ok": 14, "defect": 65}}))
    config = directory / "train-config.json"
    config.write_text(json.dumps({"epochs": 12, "batch_size": 64, "lr": 3e-4}))
    return {"model/weights.bin": weights, "eval/confusion.json": confusion, "train-config.json": config}


async def show_events(bootstrap: str, topic: str, expect: set[str]) -> None:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        seen: set[str] = set()
        while not expect <= seen:
            batch = await asyncio.wait_for(consumer.getmany(timeout_ms=1000), 30)
            for records in batch.values():
                for record in records:
                    headers = {k: v.decode() for k, v in record.headers}
                    if headers.get("ce_subject") == "defect-classifier":
                        seen.add(headers["ce_type"])
                        print(f"  event {headers['ce_type']:<34} id={headers['ce_id'][:8]} "
                              f"subject={headers['ce_subject']} partition={record.partition} offset={record.offset}")
    finally:
        await consumer.stop()


def main() -> int:
    with BundleStoreClient(TARGET) as client, tempfile.TemporaryDirectory() as tmp:
        for context in ("plant-a", "plant-b"):
            ensure_context(client, context)
        files = make_training_output(Path(tmp))
        print("1. plant-a: add and commit the defect classifier's training output")
        added = client.add("plant-a", "defect-classifier", files, commit=True,
                           values={"accuracy": 0.977, "epochs": 12, "line": "inspection-line-3"},
                           tags={"task": "vision-inspection", "stage": "candidate"},
                           lineage=pb.Lineage(code_version="main-job", parameters={"lr": "3e-4"}))
        print(f"   {added.bundle_name} {added.uuid} committed={added.committed} hash={added.content_hash[:16]}")
        print(f"2. push to {REMOTE}")
        pushed = [m for m in client.push("plant-a", added.uuid) if m.done][0]
        print(f"   {pushed.files_done}/{pushed.files_total} files, {pushed.bytes_done} bytes")
        print("3. plant-b: pull with --localize (every blob verified against its sha256)")
        pulled = [m for m in client.pull("plant-b", "defect-classifier", localize=True) if m.done][0]
        print(f"   {len(pulled.bundles)} bundle versions pulled")
        print("4. verify plant-b's copy byte for byte")
        copy = client.get_bundle("plant-b", added.uuid)
        download = Path(tmp) / "plant-b"
        client.download("plant-b", added.uuid, download)
        for path, source in files.items():
            ours = hashlib.sha256(source.read_bytes()).hexdigest()
            theirs = hashlib.sha256((download / path).read_bytes()).hexdigest()
            status = "ok" if ours == theirs else "MISMATCH"
            print(f"   {path:<24} {theirs[:16]} {status}")
            if ours != theirs:
                return 1
        assert copy.content_hash == added.content_hash, "content hash differs between contexts"
        print(f"   content hash equal in both contexts: {copy.content_hash[:16]}")
    print(f"5. events on {BUNDLES.name}")
    asyncio.run(show_events(os.environ["OPML_KAFKA_BOOTSTRAP"], BUNDLES.full_name(os.environ.get("OPML_TOPIC_PREFIX", "")),
                            {"opml.bundles.v1.BundleCommitted", "opml.bundles.v1.BundlePushed"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
