//! A TCP proxy on loopback that a test can cut and restore: a dependency (PostgreSQL,
//! Redis) that goes away mid-traffic and comes back, without touching the machine's own
//! server.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

pub struct Proxy {
    pub addr: SocketAddr,
    up: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
}

impl Proxy {
    /// Forward connections to `upstream` until [`Proxy::cut`].
    pub async fn start(upstream: SocketAddr) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let up = Arc::new(AtomicBool::new(true));
        let conns: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accept = {
            let (up, conns) = (up.clone(), conns.clone());
            tokio::spawn(async move {
                loop {
                    let Ok((mut client, _)) = listener.accept().await else {
                        continue;
                    };
                    if !up.load(Ordering::SeqCst) {
                        // Down: the connection is closed at once, as by a host that is gone.
                        drop(client);
                        continue;
                    }
                    let task = tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    conns.lock().push(task.abort_handle());
                }
            })
            .abort_handle()
        };
        Proxy {
            addr,
            up,
            conns,
            accept,
        }
    }

    /// The dependency is gone: every open connection is closed, new ones are refused.
    pub fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for c in self.conns.lock().drain(..) {
            c.abort();
        }
    }

    /// It is back.
    pub fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}
