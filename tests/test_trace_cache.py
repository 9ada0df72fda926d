"""Start-up traces kept by what decides them (images/trace_cache.py): recorded once, then read."""

from images.trace_cache import cached_trace, trace_key

TRACE = {"env": ["lib/python3.11/site-packages/mlflow/__init__.py"], "model": ["MLmodel", "model.skops"]}


def recorder(calls):
    def record():
        calls.append(1)
        return TRACE
    return record


def test_a_trace_is_recorded_once_then_read_from_the_cache(tmp_path):
    calls = []
    assert cached_trace(tmp_path, "k" * 64, recorder(calls)) == (TRACE, False)
    assert cached_trace(tmp_path, "k" * 64, recorder(calls)) == (TRACE, True)
    assert cached_trace(tmp_path, "j" * 64, recorder(calls)) == (TRACE, False)
    assert len(calls) == 2 and not list(tmp_path.glob(".*partial"))


def test_a_stored_trace_that_cannot_be_read_is_recorded_again(tmp_path):
    calls = []
    cached_trace(tmp_path, "k" * 64, recorder(calls))
    [stored] = tmp_path.glob("trace-*.json")
    for damaged in ("{not json", '{"env": []}', '{"env": [1], "model": []}'):
        stored.write_text(damaged)
        assert cached_trace(tmp_path, "k" * 64, recorder(calls)) == (TRACE, False)
    assert len(calls) == 4


def test_the_key_follows_environment_runtime_settings_and_model_file_names(tmp_path):
    (tmp_path / "MLmodel").write_text("flavors: {}")
    key = trace_key("fingerprint", "pyfunc", {"workers": 1}, tmp_path)
    assert key != trace_key("other fingerprint", "pyfunc", {"workers": 1}, tmp_path)
    assert key != trace_key("fingerprint", "vllm", {"workers": 1}, tmp_path)
    assert key != trace_key("fingerprint", "pyfunc", {"workers": 2}, tmp_path)
    (tmp_path / "MLmodel").write_text("flavors: {python_function: {}}")  # new bytes, same file: same trace
    assert key == trace_key("fingerprint", "pyfunc", {"workers": 1}, tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "tokenizer.json").write_text("{}")
    assert key != trace_key("fingerprint", "pyfunc", {"workers": 1}, tmp_path)
