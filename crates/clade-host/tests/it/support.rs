//! Shared by the VM integration tests: one VM per test binary, booted on first use.

use std::sync::OnceLock;

use clade_host::{Vm, VmSpec};
use clade_proto::{Command, ExecRequest};
use clade_testkit::{runtime, vm_env, VmTestEnv};

pub struct Shared {
    pub env: VmTestEnv,
    pub vm: Vm,
}

/// The binary's shared VM, or `None` when VM tests are skipped here.
pub fn shared() -> Option<&'static Shared> {
    static SHARED: OnceLock<Option<Shared>> = OnceLock::new();
    SHARED
        .get_or_init(|| {
            let env = vm_env()?;
            let vm = runtime().block_on(env.runtime.boot(VmSpec::new(env.image.clone()))).expect("boot the shared VM");
            Some(Shared { env, vm })
        })
        .as_ref()
}

pub fn block_on<F: std::future::Future>(future: F) -> F::Output {
    runtime().block_on(future)
}

pub fn sh(script: &str) -> ExecRequest {
    ExecRequest::new(Command::Shell(script.to_string()))
}

pub fn argv(args: &[&str]) -> ExecRequest {
    ExecRequest::new(Command::Argv(args.iter().map(|s| s.to_string()).collect()))
}

/// A counter of QEMU's `x-query-jit` (TCG only), e.g. "TB count".
pub async fn jit_counter(vm: &Vm, name: &str) -> u64 {
    let info = vm.qmp().execute("x-query-jit", None).await.unwrap();
    let text = info["human-readable-text"].as_str().unwrap();
    let line = text.lines().find_map(|l| l.strip_prefix(name)).unwrap_or_else(|| panic!("no {name} in {text}"));
    line.trim().parse().unwrap_or_else(|_| panic!("{name}: not a number in {line:?}"))
}
