"""Evaluating on an OpenAI-compatible engine, against a fake server in vLLM's shapes (the real engine: tests/test_vllm_runtime.py)."""

from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from evaluation.datasets import EvalExample, EvalSet, eval_set
from evaluation.engine_eval import EngineEvalError, EvalResult, evaluate, prompt_token_logprobs
from serving.runtime.process import free_port

SENTENCES = {f"she go home {i}.": f"She goes home {i}." for i in range(12)}
TOY_SET = EvalSet(
    "toy",
    [EvalExample(f"e{i}", [{"role": "system", "content": "Correct it."}, {"role": "user", "content": source}],
                 reference, "agreement") for i, (source, reference) in enumerate(SENTENCES.items())],
    nll_texts=["She goes home.", "We have an egg today."],  # 3 and 5 words: 2 + 4 scored tokens
)


class FakeOpenAIServer:
    """A real HTTP server on 127.0.0.1 answering like vLLM 0.32, deterministically.

    Chat: the answer in ``answers`` for the last user message, else the message echoed.
    Completions: ``prompt_logprobs`` with one "token" per word, each of log-probability
    ``token_logprob`` (vLLM's shape: null first, then {id: {logprob, rank, decoded_token}}
    with the prompt token first). ``fail`` maps a path to the status to answer instead.
    """

    def __init__(self, answers: dict[str, str], token_logprob: float = -1.0, delay_s: float = 0.0) -> None:
        self.answers, self.token_logprob, self.delay_s = answers, token_logprob, delay_s
        self.fail: dict[str, int] = {}
        self.bodies: dict[str, list[dict]] = {"/v1/chat/completions": [], "/v1/completions": []}
        self.in_flight = self.peak_in_flight = 0
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.base_url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def answer(self, path: str, body: dict) -> tuple[int, object]:
        if path in self.fail:
            return self.fail[path], {"error": {"message": "boom: engine core died", "code": self.fail[path]}}
        if path == "/v1/chat/completions":
            question = body["messages"][-1]["content"]
            content = self.answers.get(question, question)
            return 200, {"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}
        words = body["prompt"].split()
        prompt_logprobs = [None] + [
            {str(100 + i): {"logprob": self.token_logprob, "rank": 2, "decoded_token": f" {word}"},
             "7": {"logprob": -0.01, "rank": 1, "decoded_token": " the"}}  # an alternative, after the prompt token
            for i, word in enumerate(words[1:])]
        return 200, {"object": "text_completion", "choices": [
            {"index": 0, "text": " x", "finish_reason": "length", "prompt_logprobs": prompt_logprobs}]}

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    fake.bodies.setdefault(self.path, []).append(body)
                    fake.in_flight += 1
                    fake.peak_in_flight = max(fake.peak_in_flight, fake.in_flight)
                try:
                    time.sleep(fake.delay_s)
                    status, answer = fake.answer(self.path, body)
                finally:
                    with fake._lock:
                        fake.in_flight -= 1
                payload = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args):
                pass

        return Handler

    def __enter__(self) -> FakeOpenAIServer:
        threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fake():
    # Half the sentences corrected, the other half echoed unchanged.
    answers = {source: reference for i, (source, reference) in enumerate(SENTENCES.items()) if i % 2 == 0}
    with FakeOpenAIServer(answers) as server:
        yield server


def test_evaluate_scores_every_answer_and_the_nll_of_every_text(fake):
    result = evaluate(fake.base_url, "m", TOY_SET, label="baseline")
    assert (result.dataset, result.model, result.n_examples) == ("toy", "baseline", 12)
    assert set(result.outputs) == {e.id for e in TOY_SET.examples}
    assert result.outputs["e0"] == "She goes home 0." and result.outputs["e1"] == "she go home 1."
    assert result.task["exact_match"] == 0.5
    assert 0.5 < result.task["similarity"] < 1.0
    assert result.n_nll_tokens == 2 + 4  # the first token of each text has no log-probability
    assert result.nll == 1.0  # every scored token at log-probability −1, the prompt token's not the top one's


def test_answers_are_greedy_chat_completions_and_nll_comes_from_prompt_logprobs(fake):
    evaluate(fake.base_url, "served-name", TOY_SET, max_tokens=32)
    chats, completions = fake.bodies["/v1/chat/completions"], fake.bodies["/v1/completions"]
    assert len(chats) == 12 and len(completions) == 2
    assert all(b["model"] == "served-name" and b["temperature"] == 0 and b["max_tokens"] == 32 for b in chats)
    assert sorted(b["messages"][-1]["content"] for b in chats) == sorted(SENTENCES)
    assert sorted(b["prompt"] for b in completions) == sorted(TOY_SET.nll_texts)
    assert all((b["max_tokens"], b["prompt_logprobs"], b["temperature"]) == (1, 0, 0) for b in completions)


def test_no_more_than_concurrency_requests_are_in_flight():
    with FakeOpenAIServer({}, delay_s=0.05) as slow:
        evaluate(slow.base_url, "m", TOY_SET, concurrency=3)
    assert 2 <= slow.peak_in_flight <= 3


def test_duration_is_measured_with_the_injected_clock(fake):
    ticks = iter([100.0, 103.5])
    assert evaluate(fake.base_url, "m", TOY_SET, clock=lambda: next(ticks)).duration_s == 3.5


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_an_error_answer_raises_with_its_status_and_body(fake, path):
    fake.fail[path] = 500
    with pytest.raises(EngineEvalError, match="500") as error:
        evaluate(fake.base_url, "m", TOY_SET)
    assert error.value.status == 500
    assert "boom: engine core died" in str(error.value) and path in str(error.value)


def test_an_engine_that_does_not_answer_raises_engine_eval_error():
    with pytest.raises(EngineEvalError, match="failed"):
        evaluate(f"http://127.0.0.1:{free_port()}", "m", TOY_SET, timeout_s=5)


@pytest.mark.parametrize("body", [
    {"choices": [{"text": "x"}]},  # no prompt_logprobs: not vLLM, or an old one
    {"choices": [{"prompt_logprobs": [{"1": {"logprob": -1.0}}]}]},  # first position not null
    {"choices": []},
])
def test_completions_without_vllm_prompt_logprobs_are_an_engine_error(body):
    with pytest.raises(EngineEvalError, match="prompt_logprobs"):
        prompt_token_logprobs(body)


def test_a_nan_logprob_from_the_engine_gives_a_nan_nll():
    with FakeOpenAIServer({}, token_logprob=math.nan) as broken:
        assert math.isnan(evaluate(broken.base_url, "m", TOY_SET).nll)


@pytest.mark.parametrize("nll", [2.25, math.nan, math.inf])
def test_results_survive_a_json_round_trip(nll):
    result = EvalResult("toy", "candidate", {"e0": "She goes home."}, {"exact_match": 1.0, "similarity": 1.0},
                        nll, 1, 6, 3.5)
    again = EvalResult.from_json(result.to_json())
    assert again.to_json() == result.to_json()
    assert again.outputs == result.outputs and again.task == result.task
    assert (math.isnan(again.nll) and math.isnan(nll)) or again.nll == nll


# The real engine: tests/test_vllm_runtime.py evaluates the held-out set on its live vLLM server
# (one engine start for that module instead of one more here).
