//! The guest's network: `eth0` with the fixed address every sandbox has, a
//! default route through the gateway, and the gateway as the resolver
//! (see `clade_proto::guest_net`). Set once at boot, before the template is
//! saved, so every restore and fork starts with it configured.
//!
//! Done with ioctls rather than `ip`: the agent runs before any userland
//! tool could be relied on, and a missing tool must not cost the network.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;

use clade_proto::guest_net::{GATEWAY, GUEST_ADDRESS, GUEST_INTERFACE, GUEST_PREFIX};

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    #[error("no {GUEST_INTERFACE} in this VM")]
    NoInterface,
    #[error("{step} on {GUEST_INTERFACE}")]
    Ioctl {
        step: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("write /etc/resolv.conf")]
    Resolver(#[source] io::Error),
    #[error("turn IPv6 off on {GUEST_INTERFACE}")]
    Ipv6(#[source] io::Error),
}

/// Configures `eth0` (IPv4 only), the default route and /etc/resolv.conf.
pub fn configure() -> Result<(), NetError> {
    if !std::path::Path::new("/sys/class/net").join(GUEST_INTERFACE).exists() {
        return Err(NetError::NoInterface);
    }
    let socket = std::net::UdpSocket::bind(("0.0.0.0", 0)).map_err(|source| NetError::Ioctl { step: "open a socket", source })?;
    let fd = socket.as_raw_fd();
    let mask = Ipv4Addr::from(u32::MAX << (32 - u32::from(GUEST_PREFIX)));
    ipv6_off()?;
    set_address(fd, libc::SIOCSIFADDR, GUEST_ADDRESS, "set the address")?;
    set_address(fd, libc::SIOCSIFNETMASK, mask, "set the netmask")?;
    bring_up(fd)?;
    add_default_route(fd)?;
    std::fs::write("/etc/resolv.conf", format!("nameserver {GATEWAY}\noptions timeout:2 attempts:2\n")).map_err(NetError::Resolver)
}

/// The sandbox network is IPv4 only (ADR 11). With IPv6 on, bringing `eth0`
/// up starts duplicate address detection, router solicitations and MLD
/// reports whose timers outlive the template's bake: every restored sandbox
/// would finish them, sending packets nobody answers and running kernel code
/// (translated anew under TCG) on its create path. Loopback keeps `::1`.
fn ipv6_off() -> Result<(), NetError> {
    let knob = format!("/proc/sys/net/ipv6/conf/{GUEST_INTERFACE}/disable_ipv6");
    match std::fs::write(knob, "1") {
        // A kernel built without IPv6 has nothing to turn off.
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(()),
        result => result.map_err(NetError::Ipv6),
    }
}

#[allow(unsafe_code)]
fn interface_request() -> libc::ifreq {
    // SAFETY: ifreq is plain old data; all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(GUEST_INTERFACE.as_bytes()) {
        *dst = *src as libc::c_char;
    }
    req
}

#[allow(unsafe_code)]
fn sockaddr(address: Ipv4Addr) -> libc::sockaddr {
    let inet = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr { s_addr: u32::from(address).to_be() },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) and the
    // kernel reads an AF_INET sockaddr as a sockaddr_in.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(inet) }
}

#[allow(unsafe_code)]
fn set_address(fd: i32, request: libc::Ioctl, address: Ipv4Addr, step: &'static str) -> Result<(), NetError> {
    let mut req = interface_request();
    req.ifr_ifru.ifru_addr = sockaddr(address);
    // SAFETY: `req` is a fully initialised ifreq that outlives the call; the
    // kernel only reads it.
    if unsafe { libc::ioctl(fd, request, &req) } < 0 {
        return Err(NetError::Ioctl { step, source: io::Error::last_os_error() });
    }
    Ok(())
}

#[allow(unsafe_code)]
fn bring_up(fd: i32) -> Result<(), NetError> {
    let mut req = interface_request();
    // SAFETY: as in `set_address`; the kernel writes the flags member.
    if unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(NetError::Ioctl { step: "read the flags", source: io::Error::last_os_error() });
    }
    // SAFETY: SIOCGIFFLAGS succeeded, so the flags member is the one the kernel initialised.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    req.ifr_ifru.ifru_flags = flags | (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    // SAFETY: as above; the kernel only reads `req`.
    if unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(NetError::Ioctl { step: "bring it up", source: io::Error::last_os_error() });
    }
    Ok(())
}

#[allow(unsafe_code)]
fn add_default_route(fd: i32) -> Result<(), NetError> {
    // SAFETY: rtentry is plain old data; all zeroes is a valid value.
    let mut route: libc::rtentry = unsafe { std::mem::zeroed() };
    route.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
    route.rt_gateway = sockaddr(GATEWAY);
    route.rt_flags = (libc::RTF_UP | libc::RTF_GATEWAY) as libc::c_ushort;
    // SAFETY: `route` is initialised and outlives the call; the kernel only reads it.
    if unsafe { libc::ioctl(fd, libc::SIOCADDRT, &route) } < 0 {
        let error = io::Error::last_os_error();
        if error.raw_os_error() != Some(libc::EEXIST) {
            return Err(NetError::Ioctl { step: "add the default route", source: error });
        }
    }
    Ok(())
}
