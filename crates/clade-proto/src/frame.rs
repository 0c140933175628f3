//! Length-prefixed postcard frames on a substream.

use serde::{de::DeserializeOwned, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest frame either side accepts (a chunk plus its envelope fits easily).
pub const MAX_FRAME_LEN: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("i/o on the agent channel")]
    Io(#[from] std::io::Error),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_LEN}-byte limit")]
    TooLarge(usize),
    #[error("malformed frame")]
    Decode(#[from] postcard::Error),
    #[error("stream ended inside a frame")]
    Truncated,
}

/// Writes one frame and flushes it.
pub async fn write_frame<W, T>(w: &mut W, msg: &T) -> Result<(), FrameError>
where
    W: AsyncWrite + Unpin,
    T: Serialize,
{
    let body = postcard::to_allocvec(msg)?;
    if body.len() > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(body.len()));
    }
    let mut buf = Vec::with_capacity(4 + body.len());
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(&body);
    w.write_all(&buf).await?;
    w.flush().await?;
    Ok(())
}

/// Reads one frame; `Ok(None)` when the peer closed the stream between frames.
pub async fn read_frame<R, T>(r: &mut R) -> Result<Option<T>, FrameError>
where
    R: AsyncRead + Unpin,
    T: DeserializeOwned,
{
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        let n = r.read(&mut len[got..]).await?;
        if n == 0 {
            return if got == 0 { Ok(None) } else { Err(FrameError::Truncated) };
        }
        got += n;
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => FrameError::Truncated,
        _ => FrameError::Io(e),
    })?;
    Ok(Some(postcard::from_bytes(&body)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::messages::{GuestFrame, HostFrame};

    #[tokio::test]
    async fn frames_round_trip_and_eof_between_frames_is_clean() {
        let (mut a, mut b) = tokio::io::duplex(1 << 16);
        write_frame(&mut a, &HostFrame::Stdin(vec![0, 159, 255])).await.unwrap();
        write_frame(&mut a, &GuestFrame::End).await.unwrap();
        drop(a);
        let first: HostFrame = read_frame(&mut b).await.unwrap().unwrap();
        assert_eq!(first, HostFrame::Stdin(vec![0, 159, 255]));
        let second: GuestFrame = read_frame(&mut b).await.unwrap().unwrap();
        assert_eq!(second, GuestFrame::End);
        assert!(read_frame::<_, GuestFrame>(&mut b).await.unwrap().is_none());
    }

    #[tokio::test]
    async fn oversized_and_truncated_frames_are_errors() {
        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&(u32::MAX).to_le_bytes()).await.unwrap();
        assert!(matches!(read_frame::<_, GuestFrame>(&mut b).await, Err(FrameError::TooLarge(_))));

        let (mut a, mut b) = tokio::io::duplex(64);
        a.write_all(&10u32.to_le_bytes()).await.unwrap();
        a.write_all(b"abc").await.unwrap();
        drop(a);
        assert!(matches!(read_frame::<_, GuestFrame>(&mut b).await, Err(FrameError::Truncated)));
    }
}
