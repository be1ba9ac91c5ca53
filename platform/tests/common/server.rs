//! A `bulkhead serve` control plane (embedded node, real models) on a loopback port, and the
//! admin calls every test starts with.

use std::net::SocketAddr;
use std::path::PathBuf;

use bulkhead_platform::app::SharedState;
use bulkhead_platform::config::ServeConfig;
use serde_json::{Value, json};

pub struct Server {
    pub addr: SocketAddr,
    pub admin: String,
    pub http: reqwest::Client,
    pub state: SharedState,
    data: PathBuf,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
}

impl Server {
    /// Serves `cfg` (which must set `data_dir` and `admin_token`) on a free port.
    pub async fn start_with(cfg: ServeConfig) -> Server {
        let data = cfg
            .data_dir
            .clone()
            .expect("a test server needs a data dir");
        let (state, _) = bulkhead_platform::serve::build(&cfg).await.unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let served = state.clone();
        let done = tokio::spawn(async move {
            bulkhead_platform::serve::run(served, listener, async {
                let _ = rx.await;
            })
            .await
            .unwrap();
        });
        Server {
            addr,
            admin: cfg.admin_token.clone().unwrap(),
            http: reqwest::Client::new(),
            state,
            data,
            shutdown: Some(tx),
            done: Some(done),
        }
    }

    /// Graceful shutdown; gives back the data dir for a restart.
    pub async fn stop(mut self) -> PathBuf {
        let _ = self.shutdown.take().unwrap().send(());
        self.done.take().unwrap().await.unwrap();
        self.data.clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn admin_call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut r = self
            .http
            .request(method, self.url(path))
            .bearer_auth(&self.admin);
        if let Some(b) = body {
            r = r.json(&b);
        }
        let resp = r.send().await.unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    /// A new tenant and a token for it: (account id, token id, secret).
    pub async fn tenant(&self, name: &str) -> (String, String, String) {
        let (s, t) = self
            .admin_call(
                reqwest::Method::POST,
                "/admin/v1/tenants",
                Some(json!({"name": name})),
            )
            .await;
        assert_eq!(s, 200, "{t}");
        let id = t["result"]["id"].as_str().unwrap().to_string();
        let (s, tok) = self
            .admin_call(
                reqwest::Method::POST,
                &format!("/admin/v1/tenants/{id}/tokens"),
                Some(json!({"name": "test"})),
            )
            .await;
        assert_eq!(s, 200, "{tok}");
        (
            id,
            tok["result"]["id"].as_str().unwrap().into(),
            tok["result"]["token"].as_str().unwrap().into(),
        )
    }
}
