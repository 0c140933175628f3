//! `clade vm …`: VMs on this host, driven directly (no server).

use std::io::IsTerminal;
use std::os::fd::AsFd;
use std::process::ExitCode;

use anyhow::Context;
use clade_host::image::Progress;
use clade_host::vm::Phase;
use clade_host::{ExecEvent, HostConfig, Lifetime, Vm, VmRuntime, VmSpec};
use clade_proto::{Command, ExecRequest, OutputStream};
use clap::{Args, Subcommand};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::signal::unix::{signal, SignalKind};

use crate::term;

#[derive(Subcommand)]
pub enum VmCommand {
    /// Start a VM, run CMD in it with stdio attached, exit with its exit code, tear the VM down.
    Run(RunArgs),
    /// Start a VM and open an interactive shell in it (torn down on exit).
    Shell(ShellArgs),
    /// Create a VM that keeps running after this command; prints its id on the last line.
    Create(CreateArgs),
    /// Snapshot a running VM (memory, disk, processes); prints the snapshot id.
    Snapshot { id: String },
    /// List the snapshots on this host.
    Snapshots,
    /// Delete a snapshot. VMs made from it keep running; its disk layer goes with the last of them.
    RmSnapshot { snapshot: String },
    /// Fork a running VM into N new ones; prints their ids, one per line.
    Fork {
        id: String,
        #[arg(long, default_value_t = 1)]
        count: usize,
    },
    /// Run CMD in a running VM, stdio attached; exits with CMD's exit code.
    Exec(ExecArgs),
    /// List the VMs on this host (removing those whose owner is gone).
    Ls,
    /// Stop a VM's vCPUs (memory and processes are kept).
    Pause { id: String },
    /// Run a paused VM again.
    Resume { id: String },
    /// Save a VM to disk and end its QEMU process (its memory is freed).
    Hibernate { id: String },
    /// Bring a hibernated VM back: same id, processes and files.
    Wake { id: String },
    /// Stop a VM and delete everything it has.
    Rm { id: String },
}

#[derive(Args)]
pub struct CreateArgs {
    #[command(flatten)]
    vm: VmOptions,
    /// Make the VM from this snapshot instead of the image's template.
    #[arg(long)]
    from_snapshot: Option<String>,
}

#[derive(Args)]
pub struct ShellArgs {
    #[command(flatten)]
    vm: VmOptions,
    /// Cold-boot the VM instead of restoring the image's template snapshot.
    #[arg(long)]
    cold: bool,
}

#[derive(Args)]
pub struct ExecArgs {
    /// The VM's id (from `clade vm create` or `clade vm ls`).
    id: String,
    #[command(flatten)]
    command: CommandArgs,
}

#[derive(Args)]
pub struct VmOptions {
    /// The image to boot.
    #[arg(long, default_value = "base")]
    image: String,
    #[arg(long, default_value_t = 512)]
    memory_mb: u32,
    #[arg(long, default_value_t = 1)]
    vcpus: u32,
}

#[derive(Args)]
pub struct RunArgs {
    #[command(flatten)]
    vm: VmOptions,
    /// Cold-boot the VM instead of restoring the image's template snapshot (for comparisons).
    #[arg(long)]
    cold: bool,
    #[command(flatten)]
    command: CommandArgs,
}

#[derive(Args)]
pub struct CommandArgs {
    /// Forward stdin even when it is a terminal (it is forwarded whenever it is not).
    #[arg(short, long)]
    interactive: bool,
    /// Kill the command (its whole process group) after this many seconds.
    #[arg(long)]
    timeout: Option<f64>,
    /// Run as this guest user (root by default).
    #[arg(long)]
    user: Option<String>,
    /// Working directory in the guest (the user's home by default).
    #[arg(long)]
    cwd: Option<String>,
    /// Environment variables, KEY=VALUE (repeatable).
    #[arg(short, long = "env", value_parser = parse_env)]
    env: Vec<(String, String)>,
    /// The command and its arguments (after `--`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

fn parse_env(s: &str) -> Result<(String, String), String> {
    s.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())).ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

pub async fn run(command: VmCommand, config: HostConfig) -> anyhow::Result<ExitCode> {
    let runtime = VmRuntime::new(config).context("starting the VM runtime")?;
    match command {
        VmCommand::Run(args) => {
            let vm = start(&runtime, &args.vm, args.cold, Lifetime::Ephemeral).await?;
            let outcome = run_attached(&vm, args.command).await;
            vm.stop().await.context("stopping the VM")?;
            outcome
        }
        VmCommand::Create(args) => {
            let vm = match args.from_snapshot {
                Some(snapshot) => runtime.create_from_snapshot(&snapshot, Lifetime::Persistent, None).await?,
                None => start(&runtime, &args.vm, false, Lifetime::Persistent).await?,
            };
            println!("{}", vm.id());
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Snapshot { id } => {
            let snapshot = runtime.adopt(&id, None).await?.snapshot(&runtime).await?;
            println!("{snapshot}");
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Snapshots => {
            println!("ID\tSOURCE\tIMAGE\tCREATED");
            for snapshot in runtime.snapshots() {
                let created = crate::output::utc_time(snapshot.created_unix_ms as i64);
                println!("{}\t{}\t{}\t{created}", snapshot.id, snapshot.source_vm, snapshot.image);
            }
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::RmSnapshot { snapshot } => {
            let runtime = runtime.clone();
            tokio::task::spawn_blocking(move || runtime.delete_snapshot(&snapshot)).await??;
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Fork { id, count } => {
            let started = std::time::Instant::now();
            let children = runtime.adopt(&id, None).await?.fork(&runtime, count, Lifetime::Persistent).await?;
            status(&format!("forked {id} into {count} in {:.2?}", started.elapsed()));
            for child in children {
                println!("{}", child.id());
            }
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Exec(args) => {
            let vm = runtime.adopt(&args.id, None).await?;
            run_attached(&vm, args.command).await
        }
        VmCommand::Pause { id } => {
            runtime.adopt(&id, None).await?.pause().await?;
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Resume { id } => {
            runtime.adopt(&id, None).await?.resume().await?;
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Hibernate { id } => {
            let started = std::time::Instant::now();
            runtime.adopt(&id, None).await?.hibernate().await?;
            status(&format!("hibernated {id} in {:.2?}", started.elapsed()));
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Wake { id } => {
            let started = std::time::Instant::now();
            runtime.wake(&id, None).await?;
            status(&format!("woke {id} in {:.2?}", started.elapsed()));
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Rm { id } => {
            runtime.remove(&id).await?;
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Ls => {
            println!("ID\tLIFETIME\tIMAGE\tSTATE\tPID");
            for (record, running) in runtime.list() {
                let lifetime = format!("{:?}", record.lifetime).to_lowercase();
                let state = match (record.phase, running) {
                    (Phase::Hibernated, _) => "hibernated",
                    (Phase::Waking, _) => "waking",
                    (Phase::Paused, true) => "paused",
                    (Phase::Creating, true) => "creating",
                    (_, true) => "running",
                    (_, false) => "dead",
                };
                let pid = record.vmm.map_or("-".to_string(), |p| p.pid.to_string());
                println!("{}\t{lifetime}\t{}\t{state}\t{pid}", record.id, record.image);
            }
            Ok(ExitCode::SUCCESS)
        }
        VmCommand::Shell(args) => {
            let vm = start(&runtime, &args.vm, args.cold, Lifetime::Ephemeral).await?;
            let outcome = shell(&vm).await;
            vm.stop().await.context("stopping the VM")?;
            outcome
        }
    }
}

fn status(message: &str) {
    if std::io::stderr().is_terminal() {
        eprintln!("clade: {message}");
    }
}

async fn start(runtime: &VmRuntime, options: &VmOptions, cold: bool, lifetime: Lifetime) -> anyhow::Result<Vm> {
    let image = match runtime.images().cached(&options.image)? {
        Some(image) => image,
        None => {
            eprintln!("clade: image {:?} is not built yet; building it (several minutes, once)", options.image);
            let store = runtime.images().clone();
            let name = options.image.clone();
            tokio::task::spawn_blocking(move || store.ensure(&name, &Progress::Stderr)).await??
        }
    };
    let spec = VmSpec { memory_mb: options.memory_mb, vcpus: options.vcpus, lifetime, ..VmSpec::new(image) };
    if cold {
        status(&format!("cold-booting a {} VM ({})", spec.image.name, runtime.accel()));
        return Ok(runtime.boot(spec).await?);
    }
    if !runtime.has_template(&spec) {
        eprintln!("clade: first use of {} here: booting it once to bake its template snapshot", spec.image.name);
    }
    Ok(runtime.create(spec).await?)
}

async fn run_attached(vm: &Vm, args: CommandArgs) -> anyhow::Result<ExitCode> {
    let forward_stdin = args.interactive || !std::io::stdin().is_terminal();
    let command = match args.command.as_slice() {
        [single] if single.contains(char::is_whitespace) => Command::Shell(single.clone()),
        argv => Command::Argv(argv.to_vec()),
    };
    let request = ExecRequest {
        env: args.env,
        cwd: args.cwd,
        user: args.user,
        stdin: forward_stdin,
        timeout_ms: args.timeout.map(|s| (s * 1000.0) as u64),
        ..ExecRequest::new(command)
    };
    let mut session = match vm.agent().exec(request).await {
        Ok(session) => session,
        Err(e) => return Err(vm.explain(e).await.into()),
    };
    let input = session.input();
    if forward_stdin {
        let input = input.clone();
        tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                match stdin.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if input.stdin(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                }
            }
            let _ = input.close_stdin().await;
        });
    }
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut stdout = tokio::io::stdout();
    let mut stderr = tokio::io::stderr();
    let mut interrupted = false;
    loop {
        let event = tokio::select! {
            event = session.next() => event,
            _ = interrupt.recv() => { interrupted = true; let _ = input.cancel().await; continue; }
            _ = terminate.recv() => { interrupted = true; let _ = input.cancel().await; continue; }
        };
        match event {
            Ok(Some(ExecEvent::Stdout(data))) => {
                stdout.write_all(&data).await?;
                stdout.flush().await?;
            }
            Ok(Some(ExecEvent::Stderr(data))) => {
                stderr.write_all(&data).await?;
                stderr.flush().await?;
            }
            Ok(Some(ExecEvent::Truncated { stream, limit })) => {
                let which = if stream == OutputStream::Stdout { "stdout" } else { "stderr" };
                eprintln!("\nclade: [{which} truncated after {limit} bytes]");
            }
            Ok(Some(ExecEvent::Exited(status))) => {
                if status.timed_out {
                    eprintln!("clade: the command timed out and was killed");
                }
                let code = if interrupted { 130 } else { status.shell_code() };
                return Ok(ExitCode::from(code.clamp(0, 255) as u8));
            }
            Ok(None) => return Ok(ExitCode::from(crate::CLADE_FAILED)),
            Err(e) => return Err(vm.explain(e).await.into()),
        }
    }
}

async fn shell(vm: &Vm) -> anyhow::Result<ExitCode> {
    let size = term::size(std::io::stdout().as_fd()).unwrap_or(clade_proto::PtySize { rows: 24, cols: 80 });
    let term_name = std::env::var("TERM").unwrap_or_else(|_| "xterm-256color".into());
    let request = ExecRequest {
        env: vec![("TERM".into(), term_name)],
        stdin: true,
        pty: Some(size),
        ..ExecRequest::new(Command::Argv(vec!["/bin/bash".into(), "-l".into()]))
    };
    let mut session = match vm.agent().exec(request).await {
        Ok(session) => session,
        Err(e) => return Err(vm.explain(e).await.into()),
    };
    let _raw = if std::io::stdin().is_terminal() { Some(term::RawMode::enable()?) } else { None };
    let input = session.input();
    {
        let input = input.clone();
        tokio::spawn(async move {
            let mut stdin = tokio::io::stdin();
            let mut buf = vec![0u8; 4096];
            while let Ok(n) = stdin.read(&mut buf).await {
                if n == 0 || input.stdin(&buf[..n]).await.is_err() {
                    break;
                }
            }
            let _ = input.close_stdin().await;
        });
    }
    let mut winch = signal(SignalKind::window_change())?;
    let mut stdout = tokio::io::stdout();
    loop {
        let event = tokio::select! {
            event = session.next() => event,
            _ = winch.recv() => {
                if let Some(size) = term::size(std::io::stdout().as_fd()) {
                    let _ = input.resize(size).await;
                }
                continue;
            }
        };
        match event {
            Ok(Some(ExecEvent::Stdout(data) | ExecEvent::Stderr(data))) => {
                stdout.write_all(&data).await?;
                stdout.flush().await?;
            }
            Ok(Some(ExecEvent::Truncated { .. })) => {}
            Ok(Some(ExecEvent::Exited(status))) => return Ok(ExitCode::from(status.shell_code().clamp(0, 255) as u8)),
            Ok(None) => return Ok(ExitCode::from(crate::CLADE_FAILED)),
            Err(e) => return Err(vm.explain(e).await.into()),
        }
    }
}
