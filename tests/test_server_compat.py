"""What clients of other servers expect of hybrid-serve: vLLM's option names (`--max-model-len`, several
`--served-model-name`s, `--chat-template`, `--enable-auto-tool-choice`, `--generation-config`), CORS for browser
front-ends (`--allowed-origins`), and vLLM's `/tokenize`, `/detokenize` and `/version` routes."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_support import ScriptedEngine, start_server, tiny_model

from hybrid.errors import ConfigError
from server.app import load_tokenizer
from server.cli import build_parser
from server.config import CHAT, HTTP, ServerConfig

ORIGIN = "http://localhost:3000"
TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}>>{{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %}<<assistant>>{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("compat"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    engine = ScriptedEngine([])
    running = start_server(engine, model_dir, engine.max_model_len, served_model_name=("main", "alias"),
                           allowed_origins=(ORIGIN,), chat_template=TEMPLATE, generation_config="vllm")
    yield running
    running.stop()


def test_vllm_option_names_and_help_sections():
    args = build_parser().parse_args(["--max-model-len", "2048", "--served-model-name", "a", "b",
                                      "--enable-auto-tool-choice", "--allowed-origins", "*", ORIGIN])
    assert args.context_length == 2048 and args.served_model_name == ["a", "b"] and args.enable_auto_tool_choice
    assert args.allowed_origins == ["*", ORIGIN]
    sections = {group.title for group in build_parser()._action_groups}
    assert {HTTP, CHAT, "model and requests", "engine (where and how the model runs)"} <= sections
    config = ServerConfig(served_model_name=("a", "b"))
    assert config.model_name == "a" and config.model_names == ("a", "b")
    assert ServerConfig(served_model_name="one").model_names == ("one",)  # one name, as the Python API passes it


@pytest.mark.parametrize("kwargs, flag", [
    ({"allowed_origins": ("localhost:3000",)}, "--allowed-origins"),
    ({"generation_config": "/no/such/dir"}, "--generation-config"),
    ({"served_model_name": ("a", " ")}, "--served-model-name")])
def test_option_errors_name_the_flag(kwargs, flag):
    with pytest.raises(ConfigError, match=flag):
        ServerConfig(**kwargs)


def test_chat_template_is_a_file_or_the_template(tmp_path):
    file = tmp_path / "template.jinja"
    file.write_text(TEMPLATE)
    assert ServerConfig(chat_template=str(file)).chat_template_text() == TEMPLATE
    assert ServerConfig(chat_template=TEMPLATE).chat_template_text() == TEMPLATE
    with pytest.raises(ConfigError, match="--chat-template /no/such.jinja: no such file"):
        ServerConfig(chat_template="/no/such.jinja").chat_template_text()


def test_every_served_name_is_accepted(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list().data] == ["main", "alias"]
    assert client.models.retrieve("alias").id == "alias"
    ids = httpx.post(server.url + "/tokenize", json={"model": "alias", "prompt": "hi"}, timeout=30)
    assert ids.status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)


def test_generation_config_vllm_ignores_the_checkpoints_defaults(server):
    assert server.app.state.server.model.sampling_defaults == {}


def test_tokenize_a_prompt_and_chat_messages(server, tokenizer):
    prompt = httpx.post(server.url + "/tokenize", json={"prompt": "Hello there", "return_token_strs": True},
                        timeout=30).json()
    want = tokenizer.encode("Hello there")
    assert prompt["tokens"] == want and prompt["count"] == len(want) and prompt["max_model_len"] > 0
    assert prompt["token_strs"] == tokenizer.convert_ids_to_tokens(want)
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(server.url + "/tokenize", json={"messages": messages}, timeout=30).json()
    # --chat-template replaced the checkpoint's: the rendered prompt is this template's
    assert chat["tokens"] == tokenizer.encode("<<user>>Hi<<assistant>>", add_special_tokens=False)
    text = httpx.post(server.url + "/detokenize", json={"tokens": want}, timeout=30).json()
    assert text == {"prompt": tokenizer.decode(want)}
    assert httpx.get(server.url + "/version", timeout=30).json()["version"]


@pytest.mark.parametrize("body, message", [
    ({}, "either 'prompt' or 'messages'"), ({"prompt": "a", "messages": []}, "either 'prompt' or 'messages'"),
    ({"prompt": "a", "model": "other"}, "does not exist")])
def test_tokenize_errors(server, body, message):
    response = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert response.status_code in (400, 404) and message in response.json()["error"]["message"]
    bad = httpx.post(server.url + "/detokenize", json={"tokens": [10 ** 7]}, timeout=30)
    assert bad.status_code == 400 and "outside the tokenizer's vocabulary" in bad.json()["error"]["message"]


def test_cors_preflight_and_headers_for_allowed_origins_only(server):
    preflight = httpx.options(server.url + "/v1/chat/completions", timeout=30, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    listed = httpx.get(server.url + "/v1/models", headers={"Origin": ORIGIN}, timeout=30)
    assert listed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.get(server.url + "/v1/models", headers={"Origin": "http://evil.example"}, timeout=30)
    assert "access-control-allow-origin" not in other.headers
