"""The web chat page of `ember serve` in a real browser: Debian's chromium, headless, driven by playwright.

scripts/install_browser.sh finds chromium or installs it with apt-get (the test skips only when it
cannot); playwright launches that executable, so no browser is downloaded from elsewhere. One
`ember serve` subprocess with an API key serves the tiny llama, another the demo model (context window 256)
for a conversation longer than its context; each test opens the page afresh.
"""

from __future__ import annotations

import http.server
import subprocess
import threading

import pytest
from helpers import REPO_ROOT, ember_serve

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
sync_api = pytest.importorskip("playwright.sync_api")

API_KEY = "browser-key"
TIMEOUT = 60  # seconds; catches a hang, never a speed
MAX_TOKENS = 24

# Records every text the assistant messages show, as the page renders them: streaming shows
# growing prefixes of the answer, a page that waited for the whole answer would show one text.
RECORD_UPDATES = """
window.assistantTexts = [];
new MutationObserver((records) => {
  for (const record of records) {
    if (!(record.target instanceof Element) || !record.target.closest(".assistant .content")) continue;
    for (const node of record.addedNodes) if (node.nodeType === Node.TEXT_NODE) window.assistantTexts.push(node.data);
  }
}).observe(document, {childList: true, subtree: true});
"""

# Lets a chat stream through up to its first event with text, then holds the rest back until the request is
# aborted, so that Stop is pressed mid-stream however fast the model is and however the server's bytes were
# split into reads (a fast server's whole answer can arrive in the first read). The request itself is real.
HOLD_STREAM = """
const realFetch = window.fetch;
window.fetch = async (url, options) => {
  const response = await realFetch(url, options);
  if (!String(url).endsWith("chat/completions") || !response.ok) return response;
  const reader = response.body.getReader();
  const decoder = new TextDecoder(), encoder = new TextEncoder();
  const held = new ReadableStream({
    async start(controller) {
      options.signal.addEventListener("abort", () => { reader.cancel(); controller.error(options.signal.reason); });
      let buffer = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) { controller.enqueue(encoder.encode(buffer)); controller.close(); return; }
        buffer += decoder.decode(value, {stream: true});
        const events = buffer.split("\\n\\n");
        const first = events.findIndex((event) => /"content":\\s*"[^"]/.test(event));
        if (first >= 0 && first < events.length - 1) {
          controller.enqueue(encoder.encode(events.slice(0, first + 1).join("\\n\\n") + "\\n\\n"));
          return;
        }
      }
    },
  });
  return new Response(held, {status: response.status, headers: response.headers});
};
"""


# A script of another web app's page calling the API with the browser's fetch: what it got, or how the browser refused.
FETCH_CHAT = """async ([url, key, body]) => {
  try {
    const response = await fetch(url, {method: "POST", body: JSON.stringify(body),
                                       headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"}});
    return {status: response.status, reply: await response.json()};
  } catch (err) {
    return {error: String(err)};
  }
}"""  # noqa: E501 (the page script's text is kept as the browser runs it)


@pytest.fixture(scope="module")
def chromium() -> str:
    """The path of a chromium executable, installed by scripts/install_browser.sh if need be."""
    result = subprocess.run(["bash", str(REPO_ROOT / "scripts" / "install_browser.sh")], capture_output=True,
                            text=True, timeout=900)
    if result.returncode == 3:
        pytest.skip(f"no browser: {result.stderr.strip().splitlines()[-1]}")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


class _BlankPage(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><title>another web app</title>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def web_apps():
    """Two other web origins on loopback, each serving a blank page: (allowed one's URL, other one's URL)."""
    servers = [http.server.ThreadingHTTPServer(("127.0.0.1", 0), _BlankPage) for _ in range(2)]
    for web_server in servers:
        threading.Thread(target=web_server.serve_forever, daemon=True).start()
    yield tuple(f"http://127.0.0.1:{web_server.server_address[1]}" for web_server in servers)
    for web_server in servers:
        web_server.shutdown()
        web_server.server_close()


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory, web_apps):
    """`ember serve` on the tiny llama with an API key, allowing the first of `web_apps` (CORS):
    (page URL, openai client, model name)."""
    key_file = tmp_path_factory.mktemp("browser") / "key"
    key_file.write_text(API_KEY + "\n")
    with ember_serve(tiny_llama.artifact_dir, key_file, TIMEOUT, "--allow-origin", web_apps[0]) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)
        yield url + "/", client, tiny_llama.artifact_dir.name


@pytest.fixture(scope="module")
def browser(chromium):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    """The chat page, opened and given the API key it asks for."""
    context = browser.new_context(viewport={"width": 900, "height": 900})
    context.set_default_timeout(TIMEOUT * 1000)
    page = context.new_page()
    page.add_init_script(RECORD_UPDATES)
    yield page
    context.close()


def _open(page, url: str, api_key: str = API_KEY) -> None:
    page.goto(url)
    sync_api.expect(page.get_by_label("API key")).to_be_visible()  # /v1/models answered 401
    page.get_by_label("API key").fill(api_key)
    page.get_by_label("API key").press("Enter")


def _send(page, text: str, temperature: str = "0", max_tokens: str = str(MAX_TOKENS)) -> None:
    if not page.get_by_label("Temperature").is_visible():
        page.get_by_text("Settings").click()
    page.get_by_label("Temperature").fill(temperature)
    page.get_by_label("Max tokens").fill(max_tokens)
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")


def _answers(page) -> list[str]:
    """The assistant messages once the page is idle again."""
    sync_api.expect(page.get_by_role("log")).to_have_attribute("aria-busy", "false")
    return page.locator(".message.assistant .content").all_text_contents()


def _greedy(client, model: str, messages: list[dict], max_tokens: int = MAX_TOKENS) -> str:
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens)
    return reply.choices[0].message.content


def _shown(reply: str) -> str:
    """A reply as the page shows it: without the space its first token decodes with."""
    return reply.removeprefix(" ")


def test_chat_page_streams_a_conversation(page, server, tmp_path, capsys):
    url, client, model = server
    _open(page, url, api_key="wrong")
    sync_api.expect(page.get_by_role("alert")).to_contain_text("incorrect API key (HTTP 401)")
    _open(page, url)
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    sync_api.expect(page.get_by_role("heading", level=1)).to_contain_text(model)

    page.get_by_text("Settings").click()
    page.get_by_label("System prompt").fill("You are terse.")
    _send(page, "Hello, who are you?")
    sync_api.expect(page.locator(".message.assistant[data-state=done]")).to_have_count(1)
    first = _answers(page)[0]
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello, who are you?"}]
    whole_first = _greedy(client, model, messages)
    assert first and first == _shown(whole_first)
    updates = page.evaluate("window.assistantTexts")
    assert len(set(updates)) >= 2 and updates[-1] == first, updates  # shown piece by piece
    assert all(later.startswith(earlier) for earlier, later in zip(updates, updates[1:])), updates

    _send(page, "Tell me more.")  # the second turn is sent with the first
    sync_api.expect(page.locator(".message.assistant[data-state=done]")).to_have_count(2)
    second = _answers(page)[1]
    messages += [{"role": "assistant", "content": whole_first}, {"role": "user", "content": "Tell me more."}]
    assert second and second == _shown(_greedy(client, model, messages))
    assert page.locator(".message.user .content").all_text_contents() == ["Hello, who are you?", "Tell me more."]
    sync_api.expect(page.locator(".message.assistant .meta").first).to_contain_text("tokens")

    screenshot = tmp_path / "chat_page.png"
    page.screenshot(path=str(screenshot), full_page=True)
    with capsys.disabled():
        print(f"\nchat page screenshot: {screenshot}")
    assert screenshot.stat().st_size > 0

    page.get_by_role("button", name="New chat").click()
    assert page.locator(".message").count() == 0


def test_chat_page_shows_the_servers_error(page, server):
    url, _client, _model = server
    _open(page, url)
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    _send(page, "Hello", max_tokens="256")  # the prompt plus 256 tokens overflow the context window of 256
    sync_api.expect(page.get_by_role("alert")).to_contain_text("context window is 256 tokens")
    sync_api.expect(page.get_by_role("alert")).to_contain_text("(HTTP 400)")
    assert page.locator(".message").count() == 0  # the turn is withdrawn...
    assert page.get_by_label("Message").input_value() == "Hello"  # ...and back in the box, to send again
    _send(page, "Hello")
    assert len(_answers(page)) == 1 and page.locator("#error").text_content() == ""  # the error is cleared


def test_chat_page_stop_button(page, server):
    url, client, model = server
    page.add_init_script(HOLD_STREAM)
    _open(page, url)
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    stop = page.get_by_role("button", name="Stop")
    assert stop.is_disabled()
    _send(page, "Hello")
    sync_api.expect(page.locator(".message.assistant[data-state=streaming] .content")).not_to_be_empty()
    stop.click()
    sync_api.expect(page.locator(".message.assistant[data-state=stopped]")).to_have_count(1)
    sync_api.expect(page.locator(".message.assistant .meta")).to_contain_text("stopped")
    partial = _answers(page)[0]
    whole = _shown(_greedy(client, model, [{"role": "user", "content": "Hello"}]))
    assert partial and whole.startswith(partial)
    assert stop.is_disabled() and page.get_by_role("button", name="Send").is_enabled()


def test_only_allowed_origins_call_the_api_from_a_browser(page, server, web_apps):
    url, client, model = server
    allowed, other = web_apps
    messages = [{"role": "user", "content": "Hello"}]
    call = [url + "v1/chat/completions", API_KEY,
            {"model": model, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}]
    page.goto(allowed + "/")
    result = page.evaluate(FETCH_CHAT, call)
    assert result.get("status") == 200, result
    assert result["reply"]["choices"][0]["message"]["content"] == _greedy(client, model, messages)
    page.goto(other + "/")
    result = page.evaluate(FETCH_CHAT, call)
    assert result == {"error": "TypeError: Failed to fetch"}  # the browser's refusal: no CORS answer for this origin


@pytest.fixture(scope="module")
def demo_server(demo_builds, tmp_path_factory):
    """`ember serve` on the compiled demo model (context window 256) with an API key: (page URL, openai client,
    model name)."""
    artifact = demo_builds.get("cpu", "q0f32")
    key_file = tmp_path_factory.mktemp("browser-demo") / "key"
    key_file.write_text(API_KEY + "\n")
    with ember_serve(artifact, key_file, TIMEOUT) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)
        yield url + "/", client, artifact.name


def _ask(page, text: str, turn: int) -> None:
    """Send `text` as the page's `turn`th message (from 1) with whatever settings it has; wait for the reply."""
    page.get_by_label("Message").fill(text)
    page.get_by_label("Message").press("Enter")
    sync_api.expect(page.locator(".message.assistant:not([data-state=streaming])")).to_have_count(turn)


def test_the_page_asks_for_a_needed_key_without_calling_the_api(page, demo_server):
    url, _client, _model = demo_server
    requests = []
    page.on("request", lambda request: requests.append(request.url))
    page.goto(url)
    sync_api.expect(page.get_by_label("API key")).to_be_visible()
    sync_api.expect(page.locator("#key-hint")).to_contain_text("This server asks for an API key")
    sync_api.expect(page.locator("#status")).to_have_text("API key needed")
    page.wait_for_load_state("networkidle")
    assert page.locator("#error").text_content() == ""
    assert requests == [url]  # the page itself, and no API call that could only be refused


def test_a_ten_turn_conversation_on_the_demo_model_drops_the_earliest_turns(page, demo_server, tmp_path, capsys):
    """With the page's default settings (reply budget, temperature), a conversation longer than the context window
    goes on: the earliest turns are dropped, dimmed, and a note says so; the composer stays in view."""
    url, _client, _model = demo_server
    _open(page, url)
    sync_api.expect(page.locator("#status")).to_contain_text("Ready (context window 256 tokens)")
    for turn in range(1, 11):
        _ask(page, f"Tell me of the {turn}th king of Israel, and of the house of his fathers.", turn)
        assert page.locator("#error").text_content() == ""
    assert page.locator(".message.assistant[data-state=done]").count() == 10
    dropped = page.locator(".message.user.dropped").count()
    assert 1 <= dropped < 10
    note = page.get_by_role("note")
    sync_api.expect(note).to_have_count(1)
    sync_api.expect(note).to_contain_text(f"The model no longer sees the {dropped} earliest turns above (dimmed)")
    assert page.locator(".message.dropped").count() == 2 * dropped  # each turn's question and reply
    answers = _answers(page)
    assert all(answers) and not any(answer.startswith(" ") for answer in answers), answers
    # Each reply is cut at the default budget of 64 tokens (a quarter of the context) or ends before it.
    for reply in page.locator(".message.assistant").all():
        cut = reply.get_attribute("data-finish") == "length"
        assert reply.locator(".cut").count() == cut
        assert ("64 tokens" in reply.locator(".meta").text_content()) == cut
    # The conversation scrolls under the composer, following the newest text; the page itself does not scroll.
    for visible in (page.get_by_label("Message"), page.get_by_role("button", name="Send"),
                    page.locator(".message.assistant .meta").last):
        sync_api.expect(visible).to_be_in_viewport()
    assert page.evaluate("document.scrollingElement.scrollHeight <= window.innerHeight")

    note.evaluate("note => note.scrollIntoView({block: 'center'})")  # the dimmed turns above, the kept ones below
    screenshot = tmp_path / "chat_page_ten_turns.png"
    page.screenshot(path=str(screenshot))
    with capsys.disabled():
        print(f"\nchat page screenshot after ten turns: {screenshot}")
    assert screenshot.stat().st_size > 0


def test_a_reply_cut_at_the_length_limit_is_marked(page, demo_server):
    url, client, model = demo_server
    _open(page, url)
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    _send(page, "Hello", max_tokens="")  # greedy, the default reply budget
    reply = page.locator(".message.assistant")
    sync_api.expect(reply.locator(".cut")).to_have_text("… (cut at the length limit)")
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                           temperature=0, max_tokens=64)
    assert whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.content.startswith(" ")  # the API's text keeps the space...
    assert _answers(page) == [_shown(whole.choices[0].message.content)]  # ...the page shows it without
    sync_api.expect(reply.locator(".meta")).to_contain_text("64 tokens")


def test_the_api_key_survives_a_reload_until_forgotten(page, demo_server):
    url, _client, _model = demo_server
    _open(page, url)
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    page.reload()
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    sync_api.expect(page.get_by_label("API key")).to_be_hidden()
    _ask(page, "Hello", 1)
    assert page.locator("#error").text_content() == "" and _answers(page)[0]
    page.get_by_role("button", name="Forget API key").click()
    sync_api.expect(page.get_by_label("API key")).to_be_visible()
    page.reload()
    sync_api.expect(page.locator("#status")).to_have_text("API key needed")
    sync_api.expect(page.get_by_label("API key")).to_be_visible()
    assert page.locator("#error").text_content() == ""


def test_a_reload_keeps_the_conversation_and_the_model_still_sees_it(page, server):
    """Two turns, a reload: both are shown as they were, and the third turn is sent with them (its reply is the
    API's greedy reply to all three); New chat then clears what a reload brings back."""
    url, client, model = server
    _open(page, url)
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    _send(page, "Hello, who are you?")
    sync_api.expect(page.locator(".message.assistant[data-state=done]")).to_have_count(1)
    _send(page, "Tell me more.")
    sync_api.expect(page.locator(".message.assistant[data-state=done]")).to_have_count(2)
    before = _answers(page)
    page.reload()
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    assert page.locator(".message.user .content").all_text_contents() == ["Hello, who are you?", "Tell me more."]
    assert _answers(page) == before
    _send(page, "And then?")
    sync_api.expect(page.locator(".message.assistant .meta")).to_have_count(3)
    messages = [{"role": "user", "content": "Hello, who are you?"}]
    messages += [{"role": "assistant", "content": _greedy(client, model, messages)},
                 {"role": "user", "content": "Tell me more."}]
    messages += [{"role": "assistant", "content": _greedy(client, model, messages)},
                 {"role": "user", "content": "And then?"}]
    assert _answers(page)[2] == _shown(_greedy(client, model, messages))
    page.get_by_role("button", name="New chat").click()
    page.reload()
    sync_api.expect(page.locator("#status")).to_contain_text("Ready")
    assert page.locator(".message").count() == 0


def test_at_phone_width_the_title_stays_whole_on_screen(page, server):
    """At 360 px wide (a phone), the title and the model's name are within the screen, and nothing scrolls
    sideways."""
    url, _client, model = server
    page.set_viewport_size({"width": 360, "height": 740})
    _open(page, url)
    heading = page.get_by_role("heading", level=1)
    sync_api.expect(heading).to_contain_text(model)
    box = heading.bounding_box()
    assert box["x"] >= 0 and box["x"] + box["width"] <= 360, box
    assert page.evaluate("document.documentElement.scrollWidth") <= 360
