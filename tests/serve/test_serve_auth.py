"""API keys on the HTTP front end, against the in-process engine double (tests/serve/serve_doubles.py).

With ``serve.api_key`` (or ``$MMPIPE_API_KEY``) every request but ``/health`` and ``/metrics`` needs
``Authorization: Bearer <key>``; without it, 401 in OpenAI's error shape, which the official
``openai`` client raises as ``AuthenticationError``. Only loopback addresses are ever contacted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest
from serve_doubles import FakeEngine, call, error_of, running_server

from mmpipe.config import ServeConfig
from mmpipe.serve.app import API_KEY_ENV, resolve_api_key
from mmpipe.serve.server import exposure_warning, is_loopback, warn_if_exposed

KEY = "sk-test-0123456789"
VIDEO = {"prompt": "a red circle moving left", "size": "32x32"}
pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def make_cfg(**overrides: object) -> ServeConfig:
    return ServeConfig(port=0, height=32, width=32, frames=5, steps=4, **overrides)  # type: ignore[arg-type]


@pytest.fixture
def url(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A server whose key comes from the config (the environment's, set too, must lose)."""
    monkeypatch.setenv(API_KEY_ENV, "not-this-one")
    with running_server(FakeEngine(make_cfg(api_key=KEY))) as base:
        yield base


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize("path,method,body", [("/v1/models", "GET", None), ("/v1/videos", "POST", VIDEO)])
@pytest.mark.parametrize(
    "headers",
    [
        {},
        bearer("wrong"),
        bearer("not-this-one"),  # the environment's key: the config's wins
        bearer(KEY[:-1]),
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer sk-\u00e9"},  # a non-ASCII token: refused, not a server error
    ],
)
def test_requests_without_the_key_get_401_in_openais_shape(
    url: str, path: str, method: str, body: object, headers: dict[str, str]
) -> None:
    code, answer_headers, answer = call(url + path, method, body, headers=headers)
    assert code == 401, answer
    error = error_of(answer)
    assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert KEY not in answer.decode() and answer_headers["www-authenticate"] == "Bearer"


def test_requests_with_the_key_are_served(url: str) -> None:
    assert call(url + "/v1/models", headers=bearer(KEY))[0] == 200
    code, _, body = call(url + "/v1/videos", "POST", VIDEO, headers=bearer(KEY))
    assert code == 200 and json.loads(body)["status"] == "completed"
    video_id = json.loads(body)["id"]
    assert call(f"{url}/v1/videos/{video_id}")[0] == 401
    assert call(f"{url}/v1/videos/{video_id}", headers={"authorization": f"bearer {KEY}"})[0] == 200
    assert call(url + "/v1/nothing")[0] == 401  # unknown routes too: nothing is learnt without the key


def test_health_and_metrics_stay_open(url: str) -> None:
    code, _, body = call(url + "/health")
    assert code == 200 and json.loads(body) == {"status": "ok"}
    code, _, body = call(url + "/metrics")
    assert code == 200 and b"mmpipe_serve_queue_depth" in body


def test_the_openai_client_works_with_the_key_and_raises_without(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list()] == ["mmpipe-wan"]
    video = client.videos.create(prompt="a red circle moving left", size="32x32")  # type: ignore[arg-type]
    assert client.videos.retrieve(video.id).status == "completed"
    stranger = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        stranger.models.list()
    assert err.value.status_code == 401 and err.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        stranger.videos.create(prompt="a red circle moving left")


def test_the_environment_gives_the_key_when_the_config_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    with running_server(FakeEngine(make_cfg())) as url:
        monkeypatch.setenv(API_KEY_ENV, "changed")  # read once, at start
        assert call(url + "/v1/models")[0] == 401
        assert call(url + "/v1/models", headers=bearer(KEY))[0] == 200
        assert call(url + "/v1/models", headers=bearer("changed"))[0] == 401
    monkeypatch.setenv(API_KEY_ENV, "")  # empty: no key, as when unset
    with running_server(FakeEngine(make_cfg())) as url:
        assert call(url + "/v1/models")[0] == 200


def test_resolve_api_key() -> None:
    assert resolve_api_key("k", {API_KEY_ENV: "e"}) == "k"
    assert resolve_api_key(None, {API_KEY_ENV: "e"}) == "e"
    assert resolve_api_key(None, {API_KEY_ENV: ""}) is None and resolve_api_key(None, {}) is None
    with pytest.raises(ValueError, match="api_key is empty"):
        resolve_api_key(" ", {})


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_hosts_need_no_key(host: str) -> None:
    assert is_loopback(host) and exposure_warning(host, authenticated=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "example.org"])
def test_other_hosts_without_a_key_warn_once_naming_the_host(host: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert not is_loopback(host) and exposure_warning(host, authenticated=True) is None
    warn_if_exposed(host, authenticated=False)
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"host={host} " in err and "warning" in err
    warn_if_exposed(host, authenticated=True)
    assert capsys.readouterr() == ("", "")
