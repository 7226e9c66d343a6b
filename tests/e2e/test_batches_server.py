"""OpenAI's /v1/files and /v1/batches through the official `openai` SDK: a job's answers are the chat route's
tokens, its error file holds exactly the bad lines, and a server killed with SIGKILL mid-job resumes it at its
next start, answering every line exactly once."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import MODEL_NAME, ServerProcess

FLAGS = ("--kv-cache-memory", "128MiB", "--max-model-len", "256", "--max-num-seqs", "16")
BAD = {7: "not json at all", 50: json.dumps({"custom_id": "no-body", "method": "POST",
                                             "url": "/v1/chat/completions"}),
       120: json.dumps({"custom_id": "bad-temperature", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": MODEL_NAME, "temperature": "hot",
                                 "messages": [{"role": "user", "content": "hi"}]}}),
       199: json.dumps({"custom_id": "q-3", "method": "POST", "url": "/v1/chat/completions",
                        "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "again"}]}})}


def job_lines(count: int, max_tokens: int) -> list[str]:
    lines = []
    for i in range(count):
        body = {"model": MODEL_NAME, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"Count from {i} to {i + 5}."}]}
        lines.append(BAD.get(i) or json.dumps({"custom_id": f"q-{i}", "method": "POST",
                                               "url": "/v1/chat/completions", "body": body}))
    return lines


def client_of(srv: ServerProcess) -> openai.OpenAI:
    return srv.openai("k", 60)


def submit(client: openai.OpenAI, lines: list[str]) -> str:
    upload = client.files.create(file=("job.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
    assert upload.purpose == "batch" and upload.bytes > 0
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def wait_for(client: openai.OpenAI, batch_id: str, done: callable, timeout: float = 240):  # type: ignore[valid-type]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"batch {batch_id}: {batch.status} {batch.request_counts}")


def results(client: openai.OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


@pytest.mark.long
def test_a_killed_server_resumes_its_job_answering_every_line_exactly_once(tmp_path: Path) -> None:
    flags = (*FLAGS, "--batch-dir", str(tmp_path), "--api-key", "k")
    lines = job_lines(200, max_tokens=24)
    srv = ServerProcess(*flags)
    try:
        srv.wait_ready()
        client = client_of(srv)
        batch_id = submit(client, lines)
        at_kill = wait_for(client, batch_id, lambda b: b.request_counts.completed >= 20)
        srv.proc.send_signal(signal.SIGKILL)
        srv.proc.wait(30)
    finally:
        srv.stop()
    assert at_kill.status == "in_progress" and at_kill.request_counts.completed < 150  # killed mid-job

    with ServerProcess(*flags) as srv:
        client = client_of(srv)
        batch = wait_for(client, batch_id, lambda b: b.status in ("completed", "failed", "cancelled"))
        assert batch.status == "completed"
        answered, failed = results(client, batch.output_file_id), results(client, batch.error_file_id)
        assert batch.request_counts.total == 200
        assert batch.request_counts.completed == len(answered) and batch.request_counts.failed == len(failed)
        assert sorted(r["id"] for r in answered + failed) == sorted({r["id"] for r in answered + failed})
        good = {f"q-{i}" for i in range(200) if i not in BAD}
        assert sorted(r["custom_id"] for r in answered) == sorted(good)
        assert all(r["response"]["status_code"] == 200 for r in answered)
        # Exactly the bad lines: by their input line (the result id's suffix), with why.
        assert sorted(int(r["id"].rsplit("_", 1)[1]) for r in failed) == sorted(BAD)
        statuses = {r["custom_id"]: (r["response"] or {}).get("status_code") for r in failed}
        assert statuses["bad-temperature"] == 400 and statuses["no-body"] is None
        # The answers are the chat route's tokens.
        for r in answered[:3]:
            i = int(r["custom_id"][2:])
            chat = client.chat.completions.create(**json.loads(lines[i])["body"])
            assert r["response"]["body"]["choices"][0]["message"]["content"] == chat.choices[0].message.content


def test_files_and_batches_list_cancel_and_refuse_what_they_cannot_run(tmp_path: Path) -> None:
    with ServerProcess(*FLAGS, "--batch-dir", str(tmp_path), "--max-num-seqs", "2") as srv:
        client = client_of(srv)
        batch_id = submit(client, job_lines(40, max_tokens=64))
        assert batch_id in [b.id for b in client.batches.list()]
        cancelled = client.batches.cancel(batch_id)
        assert cancelled.status == "cancelled" and cancelled.request_counts.completed < 40
        assert client.files.retrieve(cancelled.input_file_id).purpose == "batch"
        assert {f.id for f in client.files.list()} >= {cancelled.input_file_id, cancelled.output_file_id}
        with pytest.raises(openai.BadRequestError):
            client.batches.create(input_file_id=cancelled.input_file_id, endpoint="/v1/audio/transcriptions",
                                  completion_window="24h")
        with pytest.raises(openai.NotFoundError):
            client.batches.retrieve("batch-../../etc")
        with pytest.raises(openai.BadRequestError):
            client.files.create(file=("x.jsonl", b"\xff\xfe"), purpose="batch")
        client.files.delete(cancelled.input_file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(cancelled.input_file_id)


def test_batch_run_answers_a_file_offline_in_input_order(tmp_path: Path) -> None:
    from pagoda.entrypoints.cli import main

    lines = [json.loads(ln) for ln in job_lines(8, max_tokens=4) if ln.startswith("{")]
    lines[5]["url"] = "/v1/completions"
    lines[5]["body"] = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([*map(json.dumps, lines[:3]), "{broken", *map(json.dumps, lines[3:])]) + "\n")
    assert main(["batch", "run", str(src), str(out), "--dtype", "float32", "--max-model-len", "256"]) == 0
    got = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["custom_id"] for r in got] == [*(x["custom_id"] for x in lines[:3]), None,
                                             *(x["custom_id"] for x in lines[3:])]
    assert got[3]["error"]["line"] == 4 and got[3]["response"] is None
    assert got[6]["response"]["body"]["object"] == "text_completion"
    assert all(r["response"]["status_code"] == 200 for i, r in enumerate(got) if i != 3)
