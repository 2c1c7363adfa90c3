//! `kvroute gateway`: the selection service plus an OpenAI-compatible front for the workers
//! (`kvroute-gateway`), on one port.

use clap::Args;
use kvroute_gateway::{Gateway, GatewayArgs};
use kvroute_service::ServeConfig;
use std::process::ExitCode;
use std::sync::Arc;

#[derive(Debug, Clone, Args)]
pub struct GatewayCmdArgs {
    #[command(flatten)]
    pub serve: ServeConfig,
    #[command(flatten)]
    pub gateway: GatewayArgs,
}

pub fn run(args: GatewayCmdArgs) -> ExitCode {
    let gateway_config = match args.gateway.validate() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("kvroute gateway: {message}");
            return ExitCode::from(2);
        }
    };
    crate::serve_cmd::run_service("gateway", "kvroute gateway", args.serve, |state| {
        let gateway = Gateway::new(Arc::clone(state), gateway_config)?;
        gateway.start_background()?;
        Ok(gateway.routes())
    })
}
