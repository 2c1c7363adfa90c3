//! The gateway's state: what every request reads, built once from the flags. Its routes are
//! in `crate::routes`, a request's dispatch in `crate::upstream`.

use crate::booking::ServiceLink;
use crate::breaker::Breakers;
use crate::client::{self, UpstreamClient};
use crate::config::GatewayConfig;
use crate::health::HealthHandle;
use crate::metrics::GatewayMetrics;
use crate::mismatch::MismatchWatch;
use crate::policy::Policy;
use crate::proxy::ResponseLimits;
use crate::tokenize::{RemoteTokenizer, TokenizeMode, Tokenizers};
use crate::workers::{self, FileDefaults, FileWorkers};
use kvroute_service::AppState;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Everything a gateway request reads.
pub struct Gateway {
    pub(crate) link: ServiceLink,
    pub(crate) config: GatewayConfig,
    pub(crate) client: UpstreamClient,
    pub(crate) health: HealthHandle,
    pub(crate) tokenizers: Tokenizers,
    pub(crate) policy: Policy,
    /// The engines' counts held against the gateway's (`tokenizer_mismatch`, `cache_mismatch`).
    pub(crate) mismatch: Arc<MismatchWatch>,
    /// Makes the request ids the gateway gives both legs of a disaggregated request unique.
    nonce: u64,
    requests: AtomicU64,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl Gateway {
    /// Loads the tokenizers, registers the flags' and the file's workers and attaches the
    /// metrics to the service's. The message of an error names the flag or file at fault.
    pub fn new(state: Arc<AppState>, config: GatewayConfig) -> Result<Arc<Self>, String> {
        let link = ServiceLink::new(state);
        let client = client::build(config.connect_timeout);
        let (metrics, registry) = GatewayMetrics::new();
        let remote = (config.tokenize == TokenizeMode::Remote).then(|| {
            RemoteTokenizer::new(
                client.clone(),
                config.upstream_authorization.clone(),
                config.first_token_timeout.min(Duration::from_secs(10)),
            )
        });
        let tokenizers = Tokenizers::load(
            &config.tokenizers,
            remote,
            metrics.untokenized_prompts.clone(),
        )?;
        workers::register(&link, &config.workers)?;
        link.attach_metrics(registry);
        Ok(Arc::new(Self {
            health: HealthHandle::new(Breakers::new(config.breaker), metrics),
            policy: Policy::new(config.policy),
            mismatch: MismatchWatch::new(link.clone()),
            link,
            config,
            client,
            tokenizers,
            nonce: rand::random(),
            requests: AtomicU64::new(0),
        }))
    }

    pub(crate) fn nonce(&self) -> u64 {
        self.nonce
    }

    pub(crate) fn next_request_number(&self) -> u64 {
        self.requests.fetch_add(1, Ordering::Relaxed)
    }

    pub fn config(&self) -> &GatewayConfig {
        &self.config
    }

    pub fn metrics(&self) -> &GatewayMetrics {
        self.health.metrics()
    }

    pub fn breakers(&self) -> &Breakers {
        self.health.breakers()
    }

    /// How long a response may take.
    pub(crate) fn response_limits(&self) -> ResponseLimits {
        ResponseLimits {
            first_token: self.config.first_token_timeout,
            whole: self.config.request_timeout,
        }
    }

    /// Starts the health checks and the workers file's watch on the current runtime; both
    /// end when the service shuts down.
    pub fn start_background(&self) -> Result<(), String> {
        if let Some(path) = &self.config.workers_file {
            let defaults = FileDefaults {
                model: self.config.default_model.clone(),
                block_size: self.config.block_size,
                max_num_batched_tokens: self.config.max_num_batched_tokens,
            };
            let file = FileWorkers::load(path, &self.link, &defaults)?;
            tokio::spawn(file.watch(
                path.clone(),
                self.config.workers_file_poll,
                defaults,
                self.link.clone(),
                self.health.clone(),
            ));
        }
        if let Some(every) = self.config.health_check_every {
            tokio::spawn(self.health.clone().run_checks(
                self.link.clone(),
                self.client.clone(),
                every,
            ));
        }
        Ok(())
    }
}
