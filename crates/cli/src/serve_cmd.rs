//! `kvroute serve`: the HTTP selection service.

use kvroute_service::http::ExtraRoutes;
use kvroute_service::{AppState, ServeConfig, http};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

/// SIGINT or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
}

pub fn run(config: ServeConfig) -> ExitCode {
    run_service("serve", "kvroute", config, |_| Ok(ExtraRoutes::default()))
}

/// Runs the selection service of `kvroute {command}` until SIGINT or SIGTERM, with the routes
/// `front` adds beside it (the gateway's); `banner` names it in the "listening" line. Dynamo's
/// queue variables are read first (the flags and `KVROUTE_*` win); a bad knob exits 2.
pub(crate) fn run_service(
    command: &str,
    banner: &str,
    mut config: ServeConfig,
    front: impl FnOnce(&Arc<AppState>) -> Result<ExtraRoutes, String>,
) -> ExitCode {
    if let Err(message) = config.apply_dynamo_env(|name| std::env::var(name).ok()) {
        eprintln!("kvroute {command}: {message}");
        return ExitCode::from(2);
    }
    let state = match AppState::new(config) {
        Ok(state) => state,
        Err(message) => {
            eprintln!("kvroute {command}: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute {command}: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let addr = SocketAddr::new(state.config().bind, state.config().port);
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("kvroute {command}: cannot listen on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        };
        // Replica sync catches up (catalog, bookings, events) before the first request.
        #[cfg(feature = "nats")]
        let _sync = match kvroute_service::sync_tasks::start(&state).await {
            Ok(tasks) => tasks,
            Err(e) => {
                eprintln!("kvroute {command}: replica sync: {e}");
                return ExitCode::FAILURE;
            }
        };
        let routes = match front(&state) {
            Ok(routes) => routes,
            Err(message) => {
                eprintln!("kvroute {command}: {message}");
                return ExitCode::from(2);
            }
        };
        let local = listener.local_addr().unwrap_or(addr);
        let profile = state.config().router_profile;
        tracing::info!(%local, %profile, "{banner} listening");
        println!("{banner} listening on http://{local}");
        match http::serve_with(state, listener, routes, shutdown_signal()).await {
            Ok(()) => {
                tracing::info!("stopped");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvroute {command}: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
