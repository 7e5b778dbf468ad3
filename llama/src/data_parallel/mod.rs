//! Data-parallel training over several devices: one replica of the model per device, each on
//! its own thread with its own optimizer; every step each replica computes the gradients of
//! its slice of the global batch and flattens them into buckets ([`BUCKET_BYTES`]), Burn's
//! all-reduce (`Tensor::all_reduce`: NCCL between CUDA devices, transfers elsewhere) averages
//! each bucket, and every replica takes the same optimizer step with its copy of the mean, so
//! the replicas stay equal.
//!
//! With a loss that is a mean over equally many tokens per slice, the average of the slices'
//! gradients is the global batch's gradient: a run on `n` devices follows the one-device run of
//! the same global batch ([`crate::finetune::train_data_parallel`]).

mod buckets;

use std::ops::Range;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, Sender, channel};
use std::thread::{Scope, ScopedJoinHandle};

use burn::module::Module;
use burn::optim::{GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Tensor};

use buckets::{BucketPlan, Flattened};

use crate::finetune::{StepContext, TrainError, replica_grads};
use crate::model::Llama;

/// The mean of `grads` (one per replica of `model`, each on its replica's device) for every
/// float parameter, once per replica on its device (in `grads`' order): what each replica's
/// optimizer step takes. Parameters without a gradient in every replica are left out. The
/// gradients travel in buckets of [`BUCKET_BYTES`] (see [`all_reduce_mean_bucketed`]).
///
/// # Panics
/// When `grads` is empty, or `model` has float parameters of a rank other than 1 or 2.
pub fn all_reduce_mean(model: &Llama, grads: Vec<GradientsParams>) -> Vec<GradientsParams> {
    all_reduce_mean_bucketed(model, grads, BUCKET_BYTES)
}

/// Bytes of gradients one all-reduce carries at most: the gradients of consecutive parameters
/// of one dtype are flattened into a bucket of up to this size, and each bucket is one
/// collective (NCCL on CUDA) instead of one per parameter (SmolLM2-135M has 272 parameters,
/// 0.54 GB of f32 gradients: three buckets).
pub const BUCKET_BYTES: usize = 256 << 20;

/// [`all_reduce_mean`] with buckets of at most `bucket_bytes` bytes (a parameter larger than
/// that is a bucket by itself): the same means, in fewer collectives.
///
/// # Panics
/// As [`all_reduce_mean`].
pub fn all_reduce_mean_bucketed(
    model: &Llama,
    grads: Vec<GradientsParams>,
    bucket_bytes: usize,
) -> Vec<GradientsParams> {
    let plan = BucketPlan::new(model, bucket_bytes);
    let flat = grads.into_iter().map(|g| plan.flatten(g)).collect();
    let (means, keep) = BucketPlan::all_reduce_mean(flat);
    means
        .into_iter()
        .map(|m| plan.unflatten(m, &keep))
        .collect()
}

/// The rows of a global batch of `batch` rows that replica `r` of `n` trains on.
pub fn replica_rows(batch: usize, n: usize, r: usize) -> Range<usize> {
    let per = batch / n;
    r * per..(r + 1) * per
}

/// Checks a replica device list before anything trains: a global batch that splits evenly.
/// A device may be listed more than once (replicas sharing it; Burn's all-reduce then runs over
/// transfers): the CPU tests run two replicas on the one CPU device.
///
/// # Errors
/// [`TrainError::Config`] naming what is wrong.
pub fn check_devices(devices: &[Device], batch: usize) -> Result<(), TrainError> {
    let n = devices.len().max(1);
    if !batch.is_multiple_of(n) {
        return Err(TrainError::Config(format!(
            "the global batch of {batch} sequences does not split evenly over {n} devices; \
             use a multiple of {n}"
        )));
    }
    Ok(())
}

/// The CUDA devices `indices` (training devices: with autodiff), after checking that each
/// exists.
///
/// # Errors
/// [`TrainError::Config`] for an index the machine does not have (with the count it has), a
/// repeated index, or no index.
#[cfg(feature = "cuda")]
pub fn cuda_devices(indices: &[usize]) -> Result<Vec<Device>, TrainError> {
    if indices.is_empty() {
        return Err(TrainError::Config("no device index given".into()));
    }
    for &i in indices {
        cubecl::Device::cuda(i)
            .map_err(|e| TrainError::Config(format!("CUDA device {i} is not available: {e}")))?;
    }
    let devices: Vec<Device> = indices
        .iter()
        .map(|&i| Device::cuda(i).autodiff())
        .collect();
    for (pos, i) in indices.iter().enumerate() {
        if indices[..pos].contains(i) {
            return Err(TrainError::Config(format!(
                "CUDA device {i} is listed twice; list each device once"
            )));
        }
    }
    Ok(devices)
}

/// Whether CUDA device `index` reaches its peers through NCCL (else Burn's all-reduce copies
/// through the host). Opens the device.
#[cfg(feature = "cuda")]
pub fn cuda_has_nccl(index: usize) -> bool {
    cubecl::Device::cuda(index).is_ok_and(|d| d.client().has_device_transport())
}

/// Host time of a step's phases, logged (`info`, target `burn_llama::data_parallel`) when the
/// environment sets `BURN_KERNELS_DP_PHASES`: where a data-parallel step spends its time
/// beside the one-device step. "grads" ends when every replica's loss is read (its forward
/// and backward done on the device); the other phases are host time of work the devices run
/// asynchronously, so their device time shows in the next step's "grads".
struct PhaseClock {
    on: bool,
    last: std::time::Instant,
    laps: Vec<(&'static str, f64)>,
}

impl PhaseClock {
    fn start() -> Self {
        Self {
            on: std::env::var_os("BURN_KERNELS_DP_PHASES").is_some(),
            last: std::time::Instant::now(),
            laps: Vec::new(),
        }
    }

    fn lap(&mut self, name: &'static str) {
        if self.on {
            let now = std::time::Instant::now();
            self.laps
                .push((name, (now - self.last).as_secs_f64() * 1e3));
            self.last = now;
        }
    }

    fn report(&self, step: usize) {
        if self.on {
            let laps: Vec<String> = self
                .laps
                .iter()
                .map(|(name, ms)| format!("{name} {ms:.1} ms"))
                .collect();
            log::info!("step {step}: {}", laps.join(", "));
        }
    }
}

/// The replicas a training run steps: one model on its device, or [`Workers`] on threads.
pub(crate) trait Replicas {
    /// One optimizer step at `lr` over step `step`'s global batch; the mean training loss.
    fn step(&mut self, step: usize, lr: f64) -> Result<f64, TrainError>;
    /// The first replica's model (validation and checkpoints read it).
    fn model(&mut self) -> Result<Llama, TrainError>;
    /// The first replica's optimizer (checkpoints save it).
    fn optimizer(&mut self) -> Result<ModuleOptimizer, TrainError>;
}

/// One replica on the caller's thread.
pub(crate) struct Single<'a> {
    /// Always `Some` between steps (taken by the optimizer step, so that it holds the only
    /// handle to each parameter and may update it in place).
    model: Option<Llama>,
    optim: ModuleOptimizer,
    ctx: StepContext<'a>,
}

impl<'a> Single<'a> {
    pub(crate) fn new(model: Llama, optim: ModuleOptimizer, ctx: StepContext<'a>) -> Self {
        Self {
            model: Some(model),
            optim,
            ctx,
        }
    }

    pub(crate) fn into_model(self) -> Llama {
        self.model.expect("a model between steps")
    }
}

impl Replicas for Single<'_> {
    fn step(&mut self, step: usize, lr: f64) -> Result<f64, TrainError> {
        let model = self.model.take().expect("a model between steps");
        let rows = 0..self.ctx.cfg.batch;
        let mut clock = PhaseClock::start();
        let result = replica_grads(&model, &self.ctx, step, rows);
        clock.lap("grads");
        let (grads, loss) = match result {
            Ok(done) => done,
            Err(e) => {
                self.model = Some(model);
                return Err(e);
            }
        };
        self.model = Some(self.optim.step(lr, model, grads));
        clock.lap("optimizer (host)");
        clock.report(step);
        Ok(loss)
    }

    fn model(&mut self) -> Result<Llama, TrainError> {
        Ok(self.model.clone().expect("a model between steps"))
    }

    fn optimizer(&mut self) -> Result<ModuleOptimizer, TrainError> {
        Ok(self.optim.clone())
    }
}

/// What the coordinator asks a worker.
enum Ask {
    /// The gradients of its rows of step `.0`'s global batch (flattened into the plan's
    /// buckets), and its mean loss.
    Grads(usize),
    /// An optimizer step at `.0` with the averaged buckets `.1`, for the parameters `.2` marks.
    Apply(f64, Vec<Tensor<1>>, Arc<Vec<bool>>),
    Model,
    Optimizer,
}

/// What a worker answers.
enum Answer {
    Grads(Result<(Flattened, f64), TrainError>),
    Applied,
    Model(Box<Llama>),
    Optimizer(ModuleOptimizer),
}

/// Replicas on threads, one per device, driven over channels by the caller's thread (the
/// coordinator, which runs the all-reduce).
pub(crate) struct Workers<'scope> {
    asks: Vec<Sender<Ask>>,
    answers: Vec<Receiver<Answer>>,
    handles: Vec<ScopedJoinHandle<'scope, Llama>>,
}

impl<'scope> Workers<'scope> {
    /// Starts one worker per device in `scope`: replica `r` is `model` forked to `devices[r]`
    /// with a copy of `optim` (and of the teacher, on the device's inner backend).
    pub(crate) fn spawn<'env>(
        scope: &'scope Scope<'scope, 'env>,
        model: Llama,
        optim: ModuleOptimizer,
        devices: &[Device],
        ctx: StepContext<'env>,
        teacher: Option<Llama>,
    ) -> Self {
        let n = devices.len();
        // The model itself is not kept, so the first device holds one copy of the weights,
        // its replica's.
        let plan = Arc::new(BucketPlan::new(&model, BUCKET_BYTES));
        let (mut asks, mut answers, mut handles) = (Vec::new(), Vec::new(), Vec::new());
        for (r, device) in devices.iter().enumerate() {
            let (ask_tx, ask_rx) = channel::<Ask>();
            let (answer_tx, answer_rx) = channel::<Answer>();
            let replica = model.clone().fork(device);
            let teacher = teacher
                .clone()
                .map(|t| t.to_device(&device.clone().inner()));
            let optim = optim.clone();
            let ctx = StepContext {
                teacher: None,
                ..ctx
            };
            let rows = replica_rows(ctx.cfg.batch, n, r);
            let plan = plan.clone();
            handles.push(scope.spawn(move || {
                let ctx = StepContext {
                    teacher: teacher.as_ref(),
                    ..ctx
                };
                worker(replica, optim, &ctx, (rows, &plan), ask_rx, answer_tx)
            }));
            asks.push(ask_tx);
            answers.push(answer_rx);
        }
        Self {
            asks,
            answers,
            handles,
        }
    }

    fn ask(&self, r: usize, ask: Ask) -> Result<(), TrainError> {
        self.asks[r].send(ask).map_err(|_| stopped(r))
    }

    fn answer(&self, r: usize) -> Result<Answer, TrainError> {
        self.answers[r].recv().map_err(|_| stopped(r))
    }

    /// Stops the workers after a failed step: joins every thread (a panicked one included, so
    /// that the scope does not panic in turn) and returns `error`.
    pub(crate) fn abandon(self, error: TrainError) -> TrainError {
        drop(self.asks);
        for h in self.handles {
            let _ = h.join();
        }
        error
    }

    /// Stops the workers and returns the first replica's model.
    ///
    /// # Errors
    /// [`TrainError::Replica`] when a worker panicked.
    pub(crate) fn finish(self) -> Result<Llama, TrainError> {
        drop(self.asks);
        let mut first = None;
        for (r, h) in self.handles.into_iter().enumerate() {
            let model = h.join().map_err(|_| stopped(r))?;
            first.get_or_insert(model);
        }
        first.ok_or_else(|| stopped(0))
    }
}

fn stopped(r: usize) -> TrainError {
    TrainError::Replica(format!(
        "replica {r} stopped (its thread panicked: see the message above)"
    ))
}

/// A worker's loop: answers asks until the coordinator hangs up, then returns its model.
/// `(rows, plan)`: its rows of each global batch, and the buckets its gradients travel in.
fn worker(
    mut model: Llama,
    mut optim: ModuleOptimizer,
    ctx: &StepContext<'_>,
    (rows, plan): (Range<usize>, &BucketPlan),
    asks: Receiver<Ask>,
    answers: Sender<Answer>,
) -> Llama {
    for ask in asks {
        let answer = match ask {
            Ask::Grads(step) => Answer::Grads(
                replica_grads(&model, ctx, step, rows.clone())
                    .map(|(grads, loss)| (plan.flatten(grads), loss)),
            ),
            Ask::Apply(lr, means, keep) => {
                model = optim.step(lr, model, plan.unflatten(means, &keep));
                Answer::Applied
            }
            Ask::Model => Answer::Model(Box::new(model.clone())),
            Ask::Optimizer => Answer::Optimizer(optim.clone()),
        };
        if answers.send(answer).is_err() {
            break;
        }
    }
    model
}

impl Replicas for Workers<'_> {
    fn step(&mut self, step: usize, lr: f64) -> Result<f64, TrainError> {
        let n = self.asks.len();
        let mut clock = PhaseClock::start();
        for r in 0..n {
            self.ask(r, Ask::Grads(step))?;
        }
        let (mut grads, mut loss) = (Vec::with_capacity(n), 0.0);
        for r in 0..n {
            match self.answer(r)? {
                Answer::Grads(result) => {
                    let (g, l) = result?;
                    grads.push(g);
                    loss += l;
                }
                _ => unreachable!("a worker answers what it was asked"),
            }
        }
        clock.lap("grads");
        let (means, keep) = BucketPlan::all_reduce_mean(grads);
        clock.lap("all-reduce (host)");
        let keep = Arc::new(keep);
        for (r, mean) in means.into_iter().enumerate() {
            self.ask(r, Ask::Apply(lr, mean, keep.clone()))?;
        }
        for r in 0..n {
            self.answer(r)?;
        }
        clock.lap("optimizer (host)");
        clock.report(step);
        Ok(loss / n as f64)
    }

    fn model(&mut self) -> Result<Llama, TrainError> {
        self.ask(0, Ask::Model)?;
        match self.answer(0)? {
            Answer::Model(m) => Ok(*m),
            _ => unreachable!("a worker answers what it was asked"),
        }
    }

    fn optimizer(&mut self) -> Result<ModuleOptimizer, TrainError> {
        self.ask(0, Ask::Optimizer)?;
        match self.answer(0)? {
            Answer::Optimizer(o) => Ok(o),
            _ => unreachable!("a worker answers what it was asked"),
        }
    }
}
