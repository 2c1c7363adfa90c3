//! `kvroute gateway`: the selection service plus an OpenAI-compatible front for the workers
//! (`kvroute-gateway`), on one port.

use clap::Args;
use kvroute_gateway::{Gateway, GatewayArgs};
use kvroute_service::{AppState, ServeConfig, http};
use std::net::SocketAddr;
use std::process::ExitCode;

#[derive(Debug, Clone, Args)]
pub struct GatewayCmdArgs {
    #[command(flatten)]
    pub serve: ServeConfig,
    #[command(flatten)]
    pub gateway: GatewayArgs,
}

pub fn run(mut args: GatewayCmdArgs) -> ExitCode {
    // Dynamo's queue variables, as `kvroute serve` reads them.
    if let Err(message) = args.serve.apply_dynamo_env(|name| std::env::var(name).ok()) {
        eprintln!("kvroute gateway: {message}");
        return ExitCode::from(2);
    }
    let gateway_config = match args.gateway.validate() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("kvroute gateway: {message}");
            return ExitCode::from(2);
        }
    };
    let state = match AppState::new(args.serve) {
        Ok(state) => state,
        Err(message) => {
            eprintln!("kvroute gateway: {message}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("kvroute gateway: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let addr = SocketAddr::new(state.config.bind, state.config.port);
        let listener = match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("kvroute gateway: cannot listen on {addr}: {e}");
                return ExitCode::FAILURE;
            }
        };
        #[cfg(feature = "nats")]
        let _sync = match kvroute_service::sync_tasks::start(&state).await {
            Ok(tasks) => tasks,
            Err(e) => {
                eprintln!("kvroute gateway: replica sync: {e}");
                return ExitCode::FAILURE;
            }
        };
        let gateway = match Gateway::new(std::sync::Arc::clone(&state), gateway_config)
            .and_then(|g| g.start_background().map(|()| g))
        {
            Ok(gateway) => gateway,
            Err(message) => {
                eprintln!("kvroute gateway: {message}");
                return ExitCode::from(2);
            }
        };
        let local = listener.local_addr().unwrap_or(addr);
        tracing::info!(%local, "kvroute gateway listening");
        println!("kvroute gateway listening on http://{local}");
        let routes = gateway.routes();
        match http::serve_with(state, listener, routes, crate::serve_cmd::shutdown_signal()).await {
            Ok(()) => {
                tracing::info!("stopped");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvroute gateway: {e}");
                ExitCode::FAILURE
            }
        }
    })
}
