//! The `clade-guestd` binary: init when it is PID 1, a plain agent otherwise.

use std::process::ExitCode;

use tracing_subscriber::EnvFilter;

const USAGE: &str = "usage: clade-guestd [--version]

As PID 1 (init=/sbin/clade-guestd) it prepares the guest and serves the host
on the virtio-serial port \"clade.agent\"; otherwise it only serves the port.
Log level: CLADE_GUESTD_LOG (e.g. debug; default info).
CLADE_GUESTD_PORT=/dev/... serves that device instead (development).";

fn main() -> ExitCode {
    let pid1 = std::process::id() == 1;
    // As init, argv holds whatever the kernel did not recognise on its
    // command line: it must not stop the boot.
    if !pid1 {
        match std::env::args().nth(1).as_deref() {
            None => {}
            Some("--version" | "-V") => {
                println!("clade-guestd {}", clade_guestd::VERSION);
                return ExitCode::SUCCESS;
            }
            Some("--help" | "-h") => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            Some(other) => {
                eprintln!("clade-guestd: unknown argument {other:?}\n{USAGE}");
                return ExitCode::from(2);
            }
        }
    }
    let filter = EnvFilter::try_from_env("CLADE_GUESTD_LOG").unwrap_or_else(|_| EnvFilter::new("info"));
    // stderr is /dev/console as init: the host keeps it as the console log.
    tracing_subscriber::fmt().with_writer(std::io::stderr).with_ansi(false).with_env_filter(filter).init();
    if pid1 {
        clade_guestd::run_init()
    } else {
        clade_guestd::run_agent()
    }
}
