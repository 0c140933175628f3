//! Execs that outlive their host ([`ExecRequest::outlives_host`]) from one
//! session to the next: `Request::Reattach`.
//!
//! A pause, a hibernation or a snapshot ends the agent's session with the
//! host, and such an exec runs on. Its frames go through its [`relay`],
//! which writes them to the substream the exec talks to and, while there is
//! none, holds them: the output's newest [`HELD_OUTPUT_LIMIT`] bytes and
//! every other frame (a truncation notice, the end). A later session
//! re-attaches by pid ([`Reattachable::attach`]): the relay writes `Started`
//! and what it held to the new substream and goes on there, and that
//! substream's host frames reach the command. An exec talks to one substream
//! at a time: a re-attach takes it over from the one before.
//!
//! An exec whose end reached a host leaves the table. One that ended with
//! no host there stays until a re-attach takes its end, at most
//! [`ENDED_KEPT`] of them: the oldest go first.
//!
//! [`ExecRequest::outlives_host`]: clade_proto::ExecRequest::outlives_host

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use clade_proto::{read_frame, write_frame, ErrorKind, GuestError, GuestFrame, HostFrame};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Output held per exec while no host is there, bytes: the newest part.
const HELD_OUTPUT_LIMIT: usize = 256 << 10;
/// Ended execs whose end no host has taken yet, kept per agent.
const ENDED_KEPT: usize = 16;

pub(crate) type FrameWriter = Box<dyn AsyncWrite + Send + Unpin>;
pub(crate) type FrameReader = Box<dyn AsyncRead + Send + Unpin>;

/// Host frames of an exec, from whichever substream it talks to; `None`
/// is that substream's end.
pub(crate) type HostFrames = mpsc::UnboundedSender<Option<HostFrame>>;

/// A substream that takes an exec over, and the session it belongs to.
pub(crate) struct Attachment {
    reader: FrameReader,
    writer: FrameWriter,
    session: CancellationToken,
}

/// The execs a later session may re-attach to, by pid.
#[derive(Default)]
pub(crate) struct Reattachable {
    table: Mutex<Table>,
}

#[derive(Default)]
struct Table {
    by_pid: HashMap<u32, Slot>,
    /// Numbers registrations (a reused pid is another exec) and ends (oldest first).
    sequence: u64,
}

struct Slot {
    registration: u64,
    attach: mpsc::UnboundedSender<Attachment>,
    /// When the exec ended with no host to tell, in `sequence` order.
    ended_unheard: Option<u64>,
}

/// An exec's place in the table, held by its relay.
pub(crate) struct Registration {
    table: Arc<Reattachable>,
    pid: u32,
    id: u64,
    attachments: mpsc::UnboundedReceiver<Attachment>,
    /// Where a re-attached substream's host frames go.
    host: HostFrames,
}

impl Reattachable {
    fn lock(&self) -> MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Enters an exec that outlives its host; its host frames from later substreams go to `host`.
    pub(crate) fn register(self: &Arc<Self>, pid: u32, host: HostFrames) -> Registration {
        let mut table = self.lock();
        table.sequence += 1;
        let id = table.sequence;
        let (attach, attachments) = mpsc::unbounded_channel();
        // A pid the kernel has reused: the exec that had it is long over.
        table.by_pid.insert(pid, Slot { registration: id, attach, ended_unheard: None });
        Registration { table: self.clone(), pid, id, attachments, host }
    }

    /// Hands `attachment` to the exec with `pid`, or gives it back when there is none.
    fn attach(&self, pid: u32, attachment: Attachment) -> Result<(), Attachment> {
        match self.lock().by_pid.get(&pid) {
            Some(slot) => slot.attach.send(attachment).map_err(|refused| refused.0),
            None => Err(attachment),
        }
    }

    fn ended_unheard(&self, registration: &Registration) {
        let mut table = self.lock();
        table.sequence += 1;
        let order = table.sequence;
        if let Some(slot) = table.by_pid.get_mut(&registration.pid).filter(|slot| slot.registration == registration.id) {
            slot.ended_unheard = Some(order);
        }
        let mut ended: Vec<(u64, u32)> =
            table.by_pid.iter().filter_map(|(pid, slot)| slot.ended_unheard.map(|order| (order, *pid))).collect();
        if ended.len() > ENDED_KEPT {
            ended.sort_unstable();
            // Dropping a slot's sender ends its relay, and what it held.
            for (_, pid) in &ended[..ended.len() - ENDED_KEPT] {
                table.by_pid.remove(pid);
            }
        }
    }

    fn leave(&self, registration: &Registration) {
        let mut table = self.lock();
        if table.by_pid.get(&registration.pid).is_some_and(|slot| slot.registration == registration.id) {
            table.by_pid.remove(&registration.pid);
        }
    }
}

/// `Request::Reattach`: hands the substream (of `session`) to the exec
/// with `pid`; when there is none, answers so and gives back the reader
/// (the host may still be sending).
pub(crate) async fn hand_over<S>(table: &Reattachable, pid: u32, stream: S, session: CancellationToken) -> Result<(), FrameReader>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (reader, writer) = tokio::io::split(stream);
    let attachment = Attachment { reader: Box::new(reader), writer: Box::new(writer), session };
    let Err(Attachment { reader, mut writer, .. }) = table.attach(pid, attachment) else { return Ok(()) };
    let message = format!("no process {pid} to re-attach to: it was not started to outlive its host, or its end was told already");
    let _ = write_frame(&mut writer, &GuestFrame::Error(GuestError::new(ErrorKind::NotFound, message))).await;
    let _ = writer.shutdown().await;
    Err(reader)
}

/// Reads a substream's host frames into `host` until the host closes it,
/// then sends `None`. It goes on reading when nobody takes them any more
/// (the command has exited): a host still sending stdin must never block on
/// the substream's flow control.
pub(crate) fn read_host_frames(mut reader: FrameReader, host: HostFrames) {
    tokio::spawn(async move {
        loop {
            match read_frame::<_, HostFrame>(&mut reader).await {
                Ok(Some(frame)) => {
                    let _ = host.send(Some(frame));
                }
                Ok(None) | Err(_) => {
                    let _ = host.send(None);
                    break;
                }
            }
        }
    });
}

/// Frames held while no host is there.
#[derive(Default)]
struct Held {
    frames: VecDeque<GuestFrame>,
    output_bytes: usize,
}

fn output_len(frame: &GuestFrame) -> Option<usize> {
    match frame {
        GuestFrame::Stdout(data) | GuestFrame::Stderr(data) => Some(data.len()),
        _ => None,
    }
}

impl Held {
    fn pop(&mut self) -> Option<GuestFrame> {
        let frame = self.frames.pop_front()?;
        self.output_bytes -= output_len(&frame).unwrap_or(0);
        Some(frame)
    }

    /// Puts back what [`Held::pop`] took and could not send.
    fn unpop(&mut self, frame: GuestFrame) {
        self.output_bytes += output_len(&frame).unwrap_or(0);
        self.frames.push_front(frame);
    }

    fn push(&mut self, frame: GuestFrame) {
        self.output_bytes += output_len(&frame).unwrap_or(0);
        self.frames.push_back(frame);
        // The oldest output goes first; the newest chunk stays even alone over the limit.
        while self.output_bytes > HELD_OUTPUT_LIMIT && self.frames.iter().filter(|frame| output_len(frame).is_some()).count() > 1 {
            if let Some(index) = self.frames.iter().position(|frame| output_len(frame).is_some()) {
                if let Some(frame) = self.frames.remove(index) {
                    self.output_bytes -= output_len(&frame).unwrap_or(0);
                }
            }
        }
    }
}

/// The substream an exec's frames go to, and the session it belongs to.
struct Outlet {
    writer: FrameWriter,
    session: CancellationToken,
}

/// Writes an exec's frames to `first`, the substream that started it (in
/// `session`), in order. Without a registration that is all: frames that
/// find the host gone are dropped. With one, they are held while no host is
/// there, and a re-attached substream takes over; the relay then lasts
/// until the exec's end reaches a host, or the table lets it go.
pub(crate) async fn relay(
    pid: u32,
    first: FrameWriter,
    session: CancellationToken,
    mut frames: mpsc::Receiver<GuestFrame>,
    mut registration: Option<Registration>,
) {
    let mut outlet = Some(Outlet { writer: first, session });
    let mut held = Held::default();
    let mut all_sent = false;
    let mut told_table = false;
    loop {
        if all_sent {
            match (outlet.as_mut(), &registration) {
                (Some(outlet), registration) => {
                    let _ = outlet.writer.shutdown().await;
                    if let Some(registration) = registration {
                        registration.table.leave(registration);
                    }
                    return;
                }
                (None, None) => return,
                (None, Some(registration)) if !told_table => {
                    registration.table.ended_unheard(registration);
                    told_table = true;
                }
                (None, Some(_)) => {}
            }
        }
        tokio::select! {
            frame = frames.recv(), if !all_sent => match frame {
                Some(frame) => {
                    if let Some(unsent) = send(&mut outlet, frame).await {
                        if registration.is_some() {
                            held.push(unsent);
                        }
                    }
                }
                None => all_sent = true,
            },
            // A frame written into a session that has ended would be lost.
            () = session_end(outlet.as_ref().map(|outlet| outlet.session.clone())) => outlet = None,
            attachment = next_attachment(&mut registration) => match (attachment, &registration) {
                (Some(Attachment { reader, writer, session }), Some(registration)) => {
                    read_host_frames(reader, registration.host.clone());
                    if let Some(mut before) = outlet.take() {
                        // Its host reads its end and lets go.
                        let _ = tokio::time::timeout(LET_GO_WITHIN, before.writer.shutdown()).await;
                    }
                    outlet = Some(Outlet { writer, session });
                    if send(&mut outlet, GuestFrame::Started { pid }).await.is_none() {
                        while let Some(frame) = held.pop() {
                            if let Some(unsent) = send(&mut outlet, frame).await {
                                held.unpop(unsent);
                                break;
                            }
                        }
                    }
                }
                // Let go by the table (an ended exec among the oldest): what it held goes.
                _ => {
                    registration = None;
                    if all_sent && outlet.is_none() {
                        return;
                    }
                }
            },
        }
    }
}

/// How long a substream that is taken over gets to hear its end.
const LET_GO_WITHIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Writes `frame` to the current substream; gives it back when there is
/// none, its session has ended, or the write fails (the substream is then
/// let go).
async fn send(outlet: &mut Option<Outlet>, frame: GuestFrame) -> Option<GuestFrame> {
    let Some(open) = outlet.as_mut().filter(|open| !open.session.is_cancelled()) else {
        *outlet = None;
        return Some(frame);
    };
    match write_frame(&mut open.writer, &frame).await {
        Ok(()) => None,
        Err(_) => {
            *outlet = None;
            Some(frame)
        }
    }
}

async fn session_end(session: Option<CancellationToken>) {
    match session {
        Some(session) => session.cancelled().await,
        None => std::future::pending().await,
    }
}

async fn next_attachment(registration: &mut Option<Registration>) -> Option<Attachment> {
    match registration {
        Some(registration) => registration.attachments.recv().await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_output_keeps_the_newest_within_its_limit_and_every_other_frame() {
        let mut held = Held::default();
        let chunk = HELD_OUTPUT_LIMIT / 4;
        for n in 0..8u8 {
            held.push(GuestFrame::Stdout(vec![n; chunk]));
            if n == 2 {
                held.push(GuestFrame::OutputTruncated { stream: clade_proto::OutputStream::Stdout, limit: 1 });
            }
        }
        held.push(GuestFrame::Exited(clade_proto::ExitStatus {
            code: Some(0),
            signal: None,
            timed_out: false,
            cancelled: false,
            stdout_dropped: 0,
            stderr_dropped: 0,
        }));
        let outputs: Vec<u8> = held.frames.iter().filter_map(|f| if let GuestFrame::Stdout(d) = f { Some(d[0]) } else { None }).collect();
        assert_eq!(outputs, vec![4, 5, 6, 7]);
        assert_eq!(held.output_bytes, HELD_OUTPUT_LIMIT);
        assert!(matches!(held.frames.front(), Some(GuestFrame::OutputTruncated { .. })));
        assert!(matches!(held.frames.back(), Some(GuestFrame::Exited(_))));
    }

    #[test]
    fn the_oldest_unheard_ends_go_past_the_limit() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let _guard = runtime.enter();
        let table = Arc::new(Reattachable::default());
        let (host, _frames) = mpsc::unbounded_channel();
        let registrations: Vec<Registration> = (1..=ENDED_KEPT as u32 + 2).map(|pid| table.register(pid, host.clone())).collect();
        for registration in &registrations {
            table.ended_unheard(registration);
        }
        let mut kept: Vec<u32> = table.lock().by_pid.keys().copied().collect();
        kept.sort_unstable();
        assert_eq!(kept, (3..=ENDED_KEPT as u32 + 2).collect::<Vec<_>>());
        // A reused pid is another exec: the old registration cannot remove it.
        let again = table.register(5, host.clone());
        table.leave(&registrations[4]);
        assert!(table.lock().by_pid.contains_key(&5));
        table.leave(&again);
        assert!(!table.lock().by_pid.contains_key(&5));
    }
}
