//! One validated request path: every surface refuses what it does not implement by name,
//! range-checks every number, and answers every rejection in its own JSON shape. Each
//! reproduction of the "one validated request path" issue is a test here, and a property
//! test throws random bodies with extreme numbers at every route.

use std::path::PathBuf;

use bulkhead_platform::config::ServeConfig;
use bulkhead_platform::limits::RateLimits;
use bulkhead_runtime::node::{MINILM_NAME, SMOLLM2_NAME};
use serde_json::{Value, json};

mod common;
use common::rand_suffix;
use common::server::Server;

const TEXT: &str = SMOLLM2_NAME;
const EMBED: &str = MINILM_NAME;
/// The bundled model's catalog limit with a 4096 window: min(2048, 4096).
const MAX_OUTPUT: u64 = 2048;

fn config(tag: &str) -> ServeConfig {
    let data: PathBuf = std::env::temp_dir().join(format!(
        "bulkhead-validation-{tag}-{}-{}",
        std::process::id(),
        rand_suffix()
    ));
    std::fs::create_dir_all(&data).unwrap();
    let mut cfg = ServeConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        data_dir: Some(data),
        admin_token: Some("admin-secret-for-tests".into()),
        limits: RateLimits {
            text_generation_per_min: 100_000,
            embeddings_per_min: 100_000,
        },
        ..ServeConfig::default()
    };
    common::smollm2_only(&mut cfg);
    // A window above the catalog's output limit, so the two limits can be told apart.
    for m in &mut cfg.node.text_models {
        m.context_window = Some(4096);
    }
    cfg
}

struct Client {
    srv: Server,
    account: String,
    token: String,
}

impl Client {
    async fn start(tag: &str) -> Client {
        let srv = Server::start_with(config(tag)).await;
        let (account, _, token) = srv.tenant("validation").await;
        Client {
            srv,
            account,
            token,
        }
    }

    async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Vec<u8>>,
    ) -> (u16, String, Value, reqwest::header::HeaderMap) {
        let path = path.replace("{acct}", &self.account);
        let mut r = self
            .srv
            .http
            .request(method, self.srv.url(&path))
            .bearer_auth(&self.token);
        if let Some(b) = body {
            r = r.header("content-type", "application/json").body(b);
        }
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        let ctype = headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string();
        let text = resp.text().await.unwrap();
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, ctype, body, headers)
    }

    async fn post(&self, path: &str, body: Value) -> (u16, String, Value) {
        let (s, c, b, _) = self
            .send(
                reqwest::Method::POST,
                path,
                Some(body.to_string().into_bytes()),
            )
            .await;
        (s, c, b)
    }

    async fn get(&self, path: &str) -> (u16, String, Value) {
        let (s, c, b, _) = self.send(reqwest::Method::GET, path, None).await;
        (s, c, b)
    }

    /// A normal generation still answers 200 with text.
    async fn still_serves(&self) {
        let (s, _, b) = self
            .post(
                &format!("/client/v4/accounts/{{acct}}/ai/run/{TEXT}"),
                json!({"prompt": "What is the capital of France?", "max_tokens": 8, "temperature": 0}),
            )
            .await;
        assert_eq!(s, 200, "{b}");
        assert!(!b["result"]["response"].as_str().unwrap().is_empty(), "{b}");
    }
}

const RUN: &str = "/client/v4/accounts/{acct}/ai/run/";
const CHAT: &str = "/v1/chat/completions";
const OAI_EMBED: &str = "/v1/embeddings";

fn run_path(model: &str) -> String {
    format!("{RUN}{model}")
}

/// An OpenAI-shaped 400 naming `param`.
fn assert_openai_param(status: u16, ctype: &str, body: &Value, param: &str) {
    assert_eq!(status, 400, "{body}");
    assert!(ctype.starts_with("application/json"), "{ctype}");
    assert_eq!(body["error"]["type"], "invalid_request_error", "{body}");
    assert_eq!(body["error"]["param"], param, "{body}");
}

/// A Workers AI envelope 400/5006 whose message names `field`.
fn assert_envelope_field(status: u16, ctype: &str, body: &Value, field: &str) {
    assert_eq!(status, 400, "{body}");
    assert!(ctype.starts_with("application/json"), "{ctype}");
    assert_eq!(body["success"], false, "{body}");
    assert_eq!(body["errors"][0]["code"], 5006, "{body}");
    let message = body["errors"][0]["message"].as_str().unwrap();
    assert!(message.contains(field), "{field} not named: {message}");
}

/// `max_tokens` of u64::MAX was a 500 (an overflow in admission); in a build without
/// overflow checks it wrapped, was admitted and panicked the engine thread.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_largest_max_tokens_is_a_400_naming_it_and_the_model_still_serves() {
    let c = Client::start("huge").await;
    let huge = u64::MAX;
    let (s, ct, b) = c
        .post(
            CHAT,
            json!({"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": huge}),
        )
        .await;
    assert_openai_param(s, &ct, &b, "max_tokens");
    let (s, ct, b) = c
        .post(
            CHAT,
            json!({"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": huge}),
        )
        .await;
    assert_openai_param(s, &ct, &b, "max_completion_tokens");
    let (s, ct, b) = c
        .post(&run_path(TEXT), json!({"prompt": "hi", "max_tokens": huge}))
        .await;
    assert_envelope_field(s, &ct, &b, "max_tokens");
    c.still_serves().await;
}

/// The OpenAI route never applied the catalog's `max_output_tokens` (Workers AI did): a
/// request for more than the model allows was served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openai_route_applies_the_catalogs_output_limit() {
    let c = Client::start("limit").await;
    let over = MAX_OUTPUT + 1;
    let (s, ct, b) = c
        .post(
            CHAT,
            json!({"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": over}),
        )
        .await;
    assert_openai_param(s, &ct, &b, "max_tokens");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("2048"),
        "{b}"
    );
    let (s, ct, b) = c
        .post(
            "/client/v4/accounts/{acct}/ai/v1/chat/completions",
            json!({"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": over}),
        )
        .await;
    assert_openai_param(s, &ct, &b, "max_completion_tokens");
    let (s, ct, b) = c
        .post(&run_path(TEXT), json!({"prompt": "hi", "max_tokens": over}))
        .await;
    assert_envelope_field(s, &ct, &b, "max_tokens");
}

/// `response_format`, `tools` and `dimensions` were accepted and ignored (a 200 with plain
/// text, no tool call, 384 dimensions): a 200 the request did not earn. (`response_format`
/// and `tools` are implemented now: what is refused is a malformed one, by the field at
/// fault.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fields_that_are_not_implemented_are_refused_by_name() {
    let c = Client::start("refused").await;
    let chat = |extra: Value| {
        let mut b = json!({"model": TEXT, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for (extra, param) in [
        (
            json!({"response_format": {"type": "json_object", "strict": true}}),
            "response_format.strict",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
                   "functions": [{"name": "f"}]}),
            "functions",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (json!({"logprobs": true}), "logprobs"),
        (json!({"n": 2}), "n"),
        (json!({"unknown_option": 1}), "unknown_option"),
        (
            json!({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}),
            "messages[0].name",
        ),
        (
            json!({"messages": [{"role": "wizard", "content": "hi"}]}),
            "messages[0].role",
        ),
    ] {
        let (s, ct, b) = c.post(CHAT, chat(extra)).await;
        assert_openai_param(s, &ct, &b, param);
    }
    let (s, ct, b) = c
        .post(
            OAI_EMBED,
            json!({"model": EMBED, "input": "hello", "dimensions": 8}),
        )
        .await;
    assert_openai_param(s, &ct, &b, "dimensions");
    for (body, field) in [
        (
            json!({"prompt": "hi", "response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
        ),
        (json!({"prompt": "hi", "tools": []}), "tools"),
        (
            json!({"prompt": "hi", "functions": [{"name": "f", "code": "x"}]}),
            "functions",
        ),
        (json!({"prompt": "hi", "lora": "x"}), "lora"),
        (json!({"prompt": "hi", "guidance": 3}), "guidance"),
    ] {
        let (s, ct, b) = c.post(&run_path(TEXT), body).await;
        assert_envelope_field(s, &ct, &b, field);
    }
    let (s, ct, b) = c
        .post(&run_path(EMBED), json!({"text": "hi", "truncate": true}))
        .await;
    assert_envelope_field(s, &ct, &b, "truncate");
    // The defaults a client may spell out are accepted.
    let (s, _, b) = c
        .post(
            CHAT,
            chat(json!({"response_format": {"type": "text"}, "tool_choice": "none", "n": 1, "logprobs": false})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
}

/// `page=18446744073709551615` dropped the connection with no answer (an overflow in the
/// offset); out-of-range paging was clamped silently.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn search_paging_is_range_checked() {
    let c = Client::start("paging").await;
    let search = "/client/v4/accounts/{acct}/ai/models/search";
    for (query, field) in [
        ("page=18446744073709551615", "page"),
        ("page=18446744073709551616", "page"),
        ("page=0", "page"),
        ("page=-1", "page"),
        ("page=1.5", "page"),
        ("per_page=0", "per_page"),
        ("per_page=101", "per_page"),
        ("per_page=abc", "per_page"),
        ("sort=name", "sort"),
    ] {
        let (s, ct, b) = c.get(&format!("{search}?{query}")).await;
        assert_envelope_field(s, &ct, &b, field);
    }
    let (s, _, b) = c.get(&format!("{search}?page=1000000&per_page=100")).await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["result"], json!([]));
    let (s, _, b) = c
        .get(&format!("{search}?author=huggingfacetb&source=1"))
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["result"][0]["name"], TEXT, "{b}");
    assert_eq!(b["result_info"]["total_count"], 1, "{b}");
    for (query, field) in [
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=99999999999999999999", "limit"),
        ("verbose=1", "verbose"),
    ] {
        let r = c
            .srv
            .http
            .get(c.srv.url(&format!("/admin/v1/audit?{query}")))
            .bearer_auth(&c.srv.admin)
            .send()
            .await
            .unwrap();
        let s = r.status().as_u16();
        let b: Value = r.json().await.unwrap();
        assert_eq!(s, 400, "{query}: {b}");
        assert!(
            b["errors"][0]["message"].as_str().unwrap().contains(field),
            "{b}"
        );
    }
}

/// axum's own rejections reached clients as `text/plain`, and unknown routes as an empty
/// 404: every answer is JSON in the shape of its surface.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_rejection_is_json_in_the_surfaces_shape() {
    let c = Client::start("shapes").await;
    // A missing query parameter.
    let (s, ct, b) = c.get("/client/v4/accounts/{acct}/ai/models/schema").await;
    assert_eq!(s, 400, "{b}");
    assert!(ct.starts_with("application/json"), "{ct}");
    assert_eq!(b["errors"][0]["code"], 5006, "{b}");
    // Unknown routes: OpenAI's shape under /v1, the envelope elsewhere.
    let (s, ct, b) = c.get("/v1/nothing-here").await;
    assert_eq!(s, 404, "{b}");
    assert!(ct.starts_with("application/json"), "{ct}");
    assert_eq!(b["error"]["type"], "not_found_error", "{b}");
    let (s, ct, b) = c.get("/client/v4/accounts/{acct}/ai/nothing-here").await;
    assert_eq!(
        (s, b["errors"][0]["code"].as_u64()),
        (404, Some(7000)),
        "{b}"
    );
    assert!(ct.starts_with("application/json"), "{ct}");
    let (s, _, b) = c.get("/admin/v1/nothing").await;
    assert_eq!(
        (s, b["errors"][0]["code"].as_u64()),
        (404, Some(7000)),
        "{b}"
    );
    // A wrong method: 405 with Allow, in the surface's shape.
    let (s, ct, b, h) = c.send(reqwest::Method::GET, CHAT, None).await;
    assert_eq!(s, 405, "{b}");
    assert!(ct.starts_with("application/json"), "{ct}");
    assert_eq!(b["error"]["type"], "invalid_request_error", "{b}");
    assert!(h.get("allow").is_some(), "{h:?}");
    let (s, _, b, h) = c.send(reqwest::Method::DELETE, &run_path(TEXT), None).await;
    assert_eq!(
        (s, b["errors"][0]["code"].as_u64()),
        (405, Some(7001)),
        "{b}"
    );
    assert!(h.get("allow").is_some(), "{h:?}");
    // A path that does not decode.
    let (s, ct, b) = c.get("/client/v4/accounts/%FF%FE/ai/usage").await;
    assert_eq!(s, 400, "{b}");
    assert!(ct.starts_with("application/json"), "{ct}");
    // Malformed JSON, a body too large, an empty body: JSON errors, never text.
    for (path, body, want) in [
        (CHAT.to_string(), b"{not json".to_vec(), 400),
        (run_path(TEXT), b"[1, 2".to_vec(), 400),
        (run_path(TEXT), vec![b' '; 2 << 20], 413),
        (OAI_EMBED.to_string(), Vec::new(), 400),
    ] {
        let (s, ct, b, _) = c.send(reqwest::Method::POST, &path, Some(body)).await;
        assert_eq!(s, want, "{path}: {b}");
        assert!(ct.starts_with("application/json"), "{path}: {ct}");
        assert!(b.is_object(), "{path}: {b}");
    }
}

/// `GET /v1/models` was a 404 with an empty body: it is OpenAI's model list, of the models
/// the tenant may use (a private one is as missing as an unknown one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_openai_model_list_shows_what_the_tenant_may_use() {
    let c = Client::start("models").await;
    let private = "@cf/validation/private-model";
    let (s, b) = c
        .srv
        .admin_call(
            reqwest::Method::POST,
            "/admin/v1/models",
            Some(json!({"name": private, "task": "text-generation", "context_window": 512})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    for path in ["/v1/models", "/client/v4/accounts/{acct}/ai/v1/models"] {
        let (s, ct, b) = c.get(path).await;
        assert_eq!(s, 200, "{b}");
        assert!(ct.starts_with("application/json"), "{ct}");
        assert_eq!(b["object"], "list");
        let ids: Vec<&str> = b["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["id"].as_str().unwrap())
            .collect();
        assert!(ids.contains(&TEXT) && ids.contains(&EMBED), "{b}");
        assert!(!ids.contains(&private), "a private model is listed: {b}");
        assert_eq!(b["data"][0]["object"], "model");
    }
    let (s, _, b) = c.get(&format!("/v1/models/{TEXT}")).await;
    assert_eq!((s, b["id"].as_str()), (200, Some(TEXT)), "{b}");
    assert_eq!(b["owned_by"], "huggingfacetb");
    let encoded = TEXT.replace('/', "%2F");
    let (s, _, b) = c
        .get(&format!(
            "/client/v4/accounts/{{acct}}/ai/v1/models/{encoded}"
        ))
        .await;
    assert_eq!(s, 200, "{b}");
    for missing in [private, "@cf/no/such-model"] {
        let (s, ct, b) = c.get(&format!("/v1/models/{missing}")).await;
        assert_eq!(s, 404, "{b}");
        assert!(ct.starts_with("application/json"), "{ct}");
        assert_eq!(b["error"]["type"], "not_found_error", "{b}");
    }
}

mod random_bodies {
    //! The property: for random JSON bodies with random field sets and extreme numbers on
    //! every route, no response is 5xx, none is 2xx unless the body was valid, and the
    //! engine answers a normal request afterwards.

    use super::*;
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};

    fn lit(json: &str) -> Value {
        serde_json::from_str(json).unwrap()
    }

    /// What no integer field takes: past u64, fractions, huge floats, other types.
    fn int_bad() -> Vec<Value> {
        vec![
            lit("18446744073709551616"),
            lit("-18446744073709551616"),
            json!(1.5),
            json!(1e300),
            json!(-1e300),
            json!("8"),
            json!(true),
            json!([1]),
            json!({}),
        ]
    }

    /// What no float field takes.
    fn float_bad() -> Vec<Value> {
        vec![
            json!(1e300),
            json!(-1e300),
            json!("0.5"),
            json!(true),
            json!([1]),
            json!({}),
        ]
    }

    /// What no string field takes.
    fn string_bad() -> Vec<Value> {
        vec![json!(8), json!(1.5), json!(true), json!([1]), json!({})]
    }

    /// What no boolean field takes.
    fn bool_bad() -> Vec<Value> {
        vec![json!(1), json!("true"), json!([true]), json!({})]
    }

    /// What no integer query parameter takes (a query carries text only).
    fn query_int_bad() -> Vec<Value> {
        vec![
            json!("18446744073709551616"),
            json!("-1"),
            json!("1.5"),
            json!("1e3"),
            json!("abc"),
            json!(""),
        ]
    }

    /// One field of a route: values it takes, and values it must refuse.
    struct Field {
        name: &'static str,
        valid: Vec<Value>,
        invalid: Vec<Value>,
        /// Sent in every body (as a valid or an invalid value).
        required: bool,
    }

    fn field(
        name: &'static str,
        valid: Vec<Value>,
        invalid: Vec<Value>,
        more: Vec<Value>,
    ) -> Field {
        let mut invalid = invalid;
        invalid.extend(more);
        Field {
            name,
            valid,
            invalid,
            required: false,
        }
    }

    fn required(mut f: Field) -> Field {
        f.required = true;
        f
    }

    struct Route {
        method: reqwest::Method,
        path: String,
        /// Fields in the body (POST) or the query (GET).
        fields: Vec<Field>,
        query: bool,
    }

    fn sampling_fields(openai: bool) -> Vec<Field> {
        let max_temp = if openai { 2.0 } else { 5.0 };
        let seed = if openai {
            // Any 64-bit signed integer is an OpenAI seed.
            field(
                "seed",
                vec![json!(7), json!(-1), json!(i64::MIN)],
                vec![json!(u64::MAX)],
                int_bad(),
            )
        } else {
            field(
                "seed",
                vec![json!(7), json!(9_999_999_999u64)],
                vec![
                    json!(0),
                    json!(-1),
                    json!(10_000_000_000u64),
                    json!(u64::MAX),
                ],
                int_bad(),
            )
        };
        vec![
            // Always present and small: valid generations stay short.
            required(field(
                if openai {
                    "max_completion_tokens"
                } else {
                    "max_tokens"
                },
                vec![json!(1), json!(2)],
                vec![json!(0), json!(-1), json!(MAX_OUTPUT + 1), json!(u64::MAX)],
                int_bad(),
            )),
            field(
                "temperature",
                vec![json!(0), json!(0.7), json!(max_temp)],
                vec![json!(max_temp + 0.1), json!(-0.1)],
                float_bad(),
            ),
            field(
                "top_p",
                vec![json!(0.5), json!(1)],
                vec![json!(0), json!(1.01)],
                float_bad(),
            ),
            seed,
            field(
                "frequency_penalty",
                vec![json!(0), json!(-2), json!(2)],
                vec![json!(2.1), json!(-2.1)],
                float_bad(),
            ),
            field(
                "presence_penalty",
                vec![json!(0.5)],
                vec![json!(-2.5)],
                float_bad(),
            ),
            field(
                "stop",
                vec![json!(["\n\n"]), json!([])],
                vec![
                    json!([""]),
                    json!(["a", "b", "c", "d", "e"]),
                    json!([1]),
                    json!(["x".repeat(65)]),
                ],
                vec![json!(8), json!(true), json!({})],
            ),
            field("stream", vec![json!(false)], vec![json!(null)], bool_bad()),
        ]
    }

    fn routes() -> Vec<Route> {
        let post = reqwest::Method::POST;
        let get = reqwest::Method::GET;
        let mut wai_text = vec![
            required(field(
                "prompt",
                vec![json!("Say one word.")],
                vec![json!(""), json!(null)],
                string_bad(),
            )),
            field("raw", vec![json!(false)], vec![json!(null)], bool_bad()),
            field(
                "top_k",
                vec![json!(1), json!(50)],
                vec![json!(0), json!(51), json!(u64::MAX)],
                int_bad(),
            ),
            field(
                "repetition_penalty",
                vec![json!(0), json!(1.1)],
                vec![json!(2.5), json!(-0.5)],
                float_bad(),
            ),
            field(
                "ignore_eos",
                vec![json!(false)],
                vec![json!(null)],
                bool_bad(),
            ),
        ];
        wai_text.extend(sampling_fields(false));
        let mut chat = vec![
            required(field(
                "model",
                vec![json!(TEXT)],
                vec![json!(""), json!(EMBED), json!("@cf/no/such-model")],
                string_bad(),
            )),
            required(field(
                "messages",
                vec![
                    json!([{"role": "user", "content": "Say one word."}]),
                    json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]),
                ],
                vec![
                    json!([]),
                    json!([{"role": "user"}]),
                    json!([{"role": "x", "content": "y"}]),
                    json!([{"role": "user", "content": "y", "name": "n"}]),
                    json!([{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]),
                    json!([{"role": "user", "content": []}]),
                ],
                string_bad(),
            )),
            field(
                "n",
                vec![json!(1)],
                vec![json!(2), json!(0), json!(u64::MAX)],
                int_bad(),
            ),
            field(
                "user",
                vec![json!("end-user-1")],
                vec![json!("u".repeat(257))],
                string_bad(),
            ),
        ];
        chat.extend(sampling_fields(true));
        let embed_openai = vec![
            required(field(
                "model",
                vec![json!(EMBED)],
                vec![json!(TEXT), json!("")],
                string_bad(),
            )),
            required(field(
                "input",
                vec![json!("hello"), json!("8"), json!(["a", "b"])],
                vec![json!(""), json!([]), json!([""]), json!(vec!["x"; 101])],
                vec![json!(8), json!(true), json!({}), json!([[1, 2]])],
            )),
            field(
                "encoding_format",
                vec![json!("float"), json!("base64")],
                vec![json!("int8")],
                string_bad(),
            ),
            field("dimensions", vec![], vec![json!(384), json!(8)], int_bad()),
        ];
        let embed_wai = vec![
            required(field(
                "text",
                vec![json!("hello"), json!(["a", "b"])],
                vec![json!(""), json!([]), json!([""]), json!(vec!["x"; 101])],
                vec![json!(8), json!(true), json!({})],
            )),
            field(
                "pooling",
                vec![json!("mean")],
                vec![json!("cls")],
                string_bad(),
            ),
        ];
        let search = vec![
            field(
                "page",
                vec![json!(1), json!(999_999)],
                vec![json!(0), json!(1_000_001)],
                query_int_bad(),
            ),
            field(
                "per_page",
                vec![json!(1), json!(100)],
                vec![json!(0), json!(101)],
                query_int_bad(),
            ),
            field(
                "task",
                vec![json!("text-generation"), json!("anything")],
                vec![],
                vec![],
            ),
            field(
                "source",
                vec![json!(1), json!(2)],
                vec![json!(0), json!(3)],
                query_int_bad(),
            ),
            field(
                "hide_experimental",
                vec![json!(true), json!(false)],
                vec![json!("yes")],
                vec![],
            ),
        ];
        let usage = vec![field(
            "days",
            vec![json!(1), json!(366)],
            vec![json!(0), json!(367)],
            query_int_bad(),
        )];
        vec![
            Route {
                method: post.clone(),
                path: run_path(TEXT),
                fields: wai_text,
                query: false,
            },
            Route {
                method: post.clone(),
                path: CHAT.into(),
                fields: chat,
                query: false,
            },
            Route {
                method: post.clone(),
                path: OAI_EMBED.into(),
                fields: embed_openai,
                query: false,
            },
            Route {
                method: post,
                path: run_path(EMBED),
                fields: embed_wai,
                query: false,
            },
            Route {
                method: get.clone(),
                path: "/client/v4/accounts/{acct}/ai/models/search".into(),
                fields: search,
                query: true,
            },
            Route {
                method: get,
                path: "/admin/v1/usage".into(),
                fields: usage,
                query: true,
            },
        ]
    }

    /// A random body for `route` and whether it is valid. Half the cases are valid (each
    /// field absent, unless required, or one of its valid values); the others have one or
    /// more fields given an invalid value, or a field no route knows.
    fn case(route: &Route) -> impl Strategy<Value = (Vec<(String, Value)>, bool)> + use<> {
        let fields: Vec<(String, bool, Vec<Value>, Vec<Value>)> = route
            .fields
            .iter()
            .map(|f| {
                (
                    f.name.to_string(),
                    f.required,
                    f.valid.clone(),
                    f.invalid.clone(),
                )
            })
            .collect();
        let n = fields.len();
        let picks: Vec<_> = fields
            .iter()
            .map(|(_, required, valid, invalid)| {
                let absent = usize::from(!*required);
                (0..absent + valid.len().max(1), 0..invalid.len().max(1))
            })
            .collect();
        (
            any::<bool>(),
            picks,
            // Mostly one field alone, so that no other invalid field can mask its refusal.
            proptest::collection::vec(proptest::bool::weighted(0.05), n),
            0..n,
        )
            .prop_map(move |(valid_case, picks, corrupt, forced)| {
                let mut out = Vec::new();
                let mut unknown = false;
                let mut corrupted = false;
                for (i, ((name, required, valid, invalid), (pick, bad))) in
                    fields.iter().zip(picks).enumerate()
                {
                    let absent = usize::from(!*required);
                    let wants_bad = !valid_case && (corrupt[i] || i == forced);
                    if wants_bad && !invalid.is_empty() {
                        out.push((name.clone(), invalid[bad].clone()));
                        corrupted = true;
                    } else if pick >= absent && !valid.is_empty() {
                        out.push((name.clone(), valid[pick - absent].clone()));
                    } else if *required {
                        out.push((name.clone(), valid[0].clone()));
                    }
                }
                if !valid_case && !corrupted {
                    unknown = true;
                }
                if unknown {
                    out.push(("x_unknown_field".into(), json!(1)));
                }
                (out, valid_case)
            })
    }

    fn query_value(v: &Value) -> String {
        match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    }

    /// Send `fields` to `route`: (status, content type, body).
    async fn send(c: &Client, route: &Route, fields: &[(String, Value)]) -> (u16, String, Value) {
        if route.query {
            let q: Vec<String> = fields
                .iter()
                .map(|(k, v)| format!("{k}={}", urlencode(&query_value(v))))
                .collect();
            let path = format!("{}?{}", route.path, q.join("&"));
            if route.path.starts_with("/admin/") {
                let r = c
                    .srv
                    .http
                    .get(c.srv.url(&path))
                    .bearer_auth(&c.srv.admin)
                    .send()
                    .await
                    .unwrap();
                let s = r.status().as_u16();
                let ct = r.headers()["content-type"].to_str().unwrap().to_string();
                return (s, ct, r.json().await.unwrap_or(Value::Null));
            }
            let (s, ct, b, _) = c.send(route.method.clone(), &path, None).await;
            return (s, ct, b);
        }
        let body: serde_json::Map<String, Value> = fields.iter().cloned().collect();
        let (s, ct, b, _) = c
            .send(
                route.method.clone(),
                &route.path,
                Some(Value::Object(body).to_string().into_bytes()),
            )
            .await;
        (s, ct, b)
    }

    /// The answer is JSON, never 5xx, 200 exactly when the request was valid, else 400.
    fn judge(
        route: &Route,
        fields: &[(String, Value)],
        valid: bool,
        (status, ctype, body): (u16, String, Value),
    ) -> Result<(), TestCaseError> {
        prop_assert!(status < 500, "{} {fields:?}: {status} {body}", route.path);
        prop_assert!(
            ctype.starts_with("application/json"),
            "{} {fields:?}: {ctype}",
            route.path
        );
        let want = if valid { 200 } else { 400 };
        prop_assert_eq!(status, want, "{} {:?}: {}", route.path, fields, body);
        Ok(())
    }

    /// A valid body of `route`: its required fields with their first valid value.
    fn minimal(route: &Route) -> Vec<(String, Value)> {
        route
            .fields
            .iter()
            .filter(|f| f.required)
            .map(|f| (f.name.to_string(), f.valid[0].clone()))
            .collect()
    }

    /// Every invalid value of every field, alone in an otherwise valid body, is refused.
    #[test]
    fn each_invalid_value_alone_is_refused() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let c = rt.block_on(Client::start("sweep"));
        for route in routes() {
            for f in &route.fields {
                for bad in &f.invalid {
                    let mut fields: Vec<_> = minimal(&route)
                        .into_iter()
                        .filter(|(k, _)| k != f.name)
                        .collect();
                    fields.push((f.name.to_string(), bad.clone()));
                    let answer = rt.block_on(send(&c, &route, &fields));
                    judge(&route, &fields, false, answer).unwrap();
                }
            }
        }
        rt.block_on(c.still_serves());
    }

    #[test]
    fn random_bodies_never_get_a_5xx_or_an_unearned_2xx() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        let c = rt.block_on(Client::start("property"));
        for route in routes() {
            let mut runner = TestRunner::new(Config {
                cases: 64,
                failure_persistence: None,
                ..Config::default()
            });
            let result = runner.run(&case(&route), |(fields, valid)| {
                let answer = rt.block_on(send(&c, &route, &fields));
                judge(&route, &fields, valid, answer)
            });
            if let Err(e) = result {
                panic!("{}: {e}", route.path);
            }
        }
        rt.block_on(c.still_serves());
    }

    fn urlencode(s: &str) -> String {
        s.bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect()
    }
}

/// `response_format` on both surfaces holds the real model's answer to the schema (sampled,
/// from the 135M model); a schema the engine cannot use is a 400 before any token, and the
/// model serves the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn structured_outputs_on_both_surfaces() {
    let c = Client::start("structured").await;
    let schema = json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "country": {"enum": ["France", "Italy", "Spain"]},
            "population": {"type": "integer", "minimum": 1}
        },
        "required": ["city", "country", "population"],
        "additionalProperties": false
    });
    let check = |text: &str| {
        let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert!(v["city"].as_str().unwrap().chars().count() <= 24, "{text}");
        assert!(
            ["France", "Italy", "Spain"].contains(&v["country"].as_str().unwrap()),
            "{text}"
        );
        assert!(v["population"].as_i64().unwrap() >= 1, "{text}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
    };
    let (s, _, b) = c
        .post(
            CHAT,
            json!({"model": TEXT, "max_tokens": 120, "temperature": 1.0, "seed": 3,
                   "messages": [{"role": "user", "content": "Name a big city in Europe."}],
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "city", "strict": true, "schema": schema}}}),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert_eq!(b["choices"][0]["finish_reason"], "stop", "{b}");
    check(b["choices"][0]["message"]["content"].as_str().unwrap());

    let (s, _, b) = c
        .post(
            &run_path(TEXT),
            json!({"messages": [{"role": "user", "content": "Name a big city in Europe."}],
                   "max_tokens": 120, "temperature": 1.0, "seed": 4,
                   "response_format": {"type": "json_schema", "json_schema": schema}}),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    // Workers AI's JSON mode: the object itself.
    assert!(b["result"]["response"].is_object(), "{b}");
    check(&b["result"]["response"].to_string());

    // Compiled by the engine, refused as the client's error.
    let (s, ct, b) = c
        .post(
            CHAT,
            json!({"model": TEXT, "max_tokens": 8,
                   "messages": [{"role": "user", "content": "hi"}],
                   "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                       "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}}}),
        )
        .await;
    assert_eq!(s, 400, "{b}");
    assert!(ct.starts_with("application/json"), "{ct}");
    assert!(
        b["error"]["message"]
            .as_str()
            .unwrap()
            .contains("response_format"),
        "{b}"
    );
    c.still_serves().await;
}

/// The data of each `data:` line of an SSE body.
fn sse_data(body: &Value) -> Vec<String> {
    body.as_str()
        .unwrap_or_else(|| panic!("not an SSE body: {body}"))
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .map(str::to_string)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn function_calling_on_both_surfaces() {
    let c = Client::start("tools").await;
    let params = json!({"type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24},
                       "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": false});
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city", "parameters": params}}]);
    let check = |name: &Value, arguments: &str| {
        assert_eq!(name, "get_weather");
        let v: Value =
            serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{e}: {arguments}"));
        assert!(
            v["city"].as_str().unwrap().chars().count() <= 24,
            "{arguments}"
        );
        assert!(
            ["celsius", "fahrenheit"].contains(&v["unit"].as_str().unwrap()),
            "{arguments}"
        );
        assert_eq!(v.as_object().unwrap().len(), 2, "{arguments}");
    };
    let ask = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    let chat = |extra: Value| {
        let mut b = json!({"model": TEXT, "max_tokens": 300, "temperature": 1.0, "seed": 5,
                           "messages": ask, "tools": tools, "tool_choice": "required"});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };

    // OpenAI: the call, no content, finish_reason tool_calls.
    let (s, _, b) = c
        .post(CHAT, chat(json!({"parallel_tool_calls": false})))
        .await;
    assert_eq!(s, 200, "{b}");
    let choice = &b["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{b}");
    assert!(choice["message"]["content"].is_null(), "{b}");
    let calls = choice["message"]["tool_calls"].as_array().unwrap();
    assert_eq!(calls.len(), 1, "{b}");
    assert!(calls[0]["id"].as_str().unwrap().starts_with("call_"), "{b}");
    check(
        &calls[0]["function"]["name"],
        calls[0]["function"]["arguments"].as_str().unwrap(),
    );

    // The call and its result sent back: a text answer.
    let history = json!([ask[0], choice["message"],
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "{\"temperature\": 18}"}]);
    let (s, _, b) = c
        .post(
            CHAT,
            chat(json!({"messages": history, "tool_choice": "none", "max_tokens": 16})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    assert!(
        b["choices"][0]["message"]["content"]
            .as_str()
            .is_some_and(|t| !t.is_empty()),
        "{b}"
    );
    assert!(
        b["choices"][0]["message"].get("tool_calls").is_none(),
        "{b}"
    );

    // Streamed: the first delta of a call has its id and name, then the arguments in pieces.
    let (s, _, b) = c
        .post(
            CHAT,
            chat(json!({"stream": true, "parallel_tool_calls": false})),
        )
        .await;
    assert_eq!(s, 200, "{b}");
    let frames = sse_data(&b);
    assert_eq!(frames.last().map(String::as_str), Some("[DONE]"));
    let (mut name, mut arguments, mut pieces, mut finish) =
        (Value::Null, String::new(), 0, Value::Null);
    for f in &frames[..frames.len() - 1] {
        let v: Value = serde_json::from_str(f).unwrap();
        let choice = &v["choices"][0];
        if let Some(call) = choice["delta"]["tool_calls"].get(0) {
            assert_eq!(call["index"], 0, "{f}");
            if let Some(id) = call.get("id") {
                assert!(
                    id.as_str().unwrap().starts_with("call_") && name.is_null(),
                    "{f}"
                );
                name = call["function"]["name"].clone();
            }
            arguments.push_str(call["function"]["arguments"].as_str().unwrap());
            pieces += 1;
        }
        if !choice["finish_reason"].is_null() {
            finish = choice["finish_reason"].clone();
        }
    }
    assert_eq!(finish, "tool_calls");
    assert!(pieces > 2, "{frames:?}");
    check(&name, &arguments);

    // Workers AI: tool_calls in both shapes, and streamed one frame per whole call.
    let run = json!({"messages": ask, "tools": tools, "tool_choice": "required",
                     "max_tokens": 300, "temperature": 1.0, "seed": 6});
    let (s, _, b) = c.post(&run_path(TEXT), run.clone()).await;
    assert_eq!(s, 200, "{b}");
    let call = &b["result"]["tool_calls"][0];
    check(&call["name"], &call["arguments"].to_string());
    let text: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(call["arguments"], text, "{b}");
    let mut streamed = run.clone();
    streamed["stream"] = json!(true);
    let (s, _, b) = c.post(&run_path(TEXT), streamed).await;
    assert_eq!(s, 200, "{b}");
    let frames = sse_data(&b);
    let calls: Vec<Value> = frames
        .iter()
        .filter_map(|f| serde_json::from_str::<Value>(f).ok())
        .filter_map(|v| v.get("tool_calls").cloned())
        .collect();
    assert!(!calls.is_empty(), "{frames:?}");
    check(
        &calls[0][0]["function"]["name"],
        calls[0][0]["function"]["arguments"].as_str().unwrap(),
    );

    // A tool schema the engine cannot use: the client's 400, naming tools.
    let mut bad = tools.clone();
    bad[0]["function"]["parameters"] =
        json!({"type": "object", "properties": {"a": {"$ref": "#/nope"}}});
    let (s, _, b) = c.post(CHAT, chat(json!({"tools": bad}))).await;
    assert_eq!(s, 400, "{b}");
    assert!(
        b["error"]["message"].as_str().unwrap().contains("tools"),
        "{b}"
    );
    c.still_serves().await;
}
