//! End-to-end test over real QUIC + TLS on loopback.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tether_transport::codec::{
    CodecError, FRAME_BYTES_MAX, FrameReader, encode_frame, write_frame,
};
use tether_transport::tls::SERVER_NAME;
use tether_transport::{
    ALPN, ErrorCode, client_config, client_endpoint, ensure_dev_certs, install_crypto_provider,
    server_config, server_endpoint,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Msg {
    seq: u32,
    text: String,
    #[serde(with = "serde_bytes")]
    payload: Vec<u8>,
}

const TEST_TIMEOUT: Duration = Duration::from_secs(20);

/// Server side: stream 1 echoes frames; stream 2 must fail with TooLarge; stream 3 must fail
/// with Truncated. Each failure is answered with the matching error code as one frame.
async fn serve(endpoint: quinn::Endpoint) {
    let conn = endpoint.accept().await.unwrap().await.unwrap();
    assert_eq!(
        conn.handshake_data()
            .unwrap()
            .downcast::<quinn::crypto::rustls::HandshakeData>()
            .unwrap()
            .protocol
            .unwrap(),
        ALPN
    );

    // 1: echo
    let (mut send, recv) = conn.accept_bi().await.unwrap();
    let mut reader = FrameReader::new(recv);
    while let Some(m) = reader.next::<Msg>().await.unwrap() {
        write_frame(&mut send, &m).await.unwrap();
    }
    send.finish().unwrap();

    // 2: oversize header
    let (mut send, recv) = conn.accept_bi().await.unwrap();
    let mut reader = FrameReader::new(recv);
    match reader.next_raw().await {
        Err(e @ CodecError::TooLarge { .. }) => {
            assert!(
                matches!(e, CodecError::TooLarge { size, max } if size == FRAME_BYTES_MAX + 1 && max == FRAME_BYTES_MAX)
            );
            write_frame(&mut send, &e.code()).await.unwrap();
            reader.get_mut().stop(e.code().varint()).ok();
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    send.finish().unwrap();

    // 3: truncated
    let (mut send, recv) = conn.accept_bi().await.unwrap();
    let mut reader = FrameReader::new(recv);
    match reader.next::<Msg>().await {
        Err(e @ CodecError::Truncated { .. }) => {
            write_frame(&mut send, &ErrorCode::MalformedFrame)
                .await
                .unwrap();
            assert_eq!(e.code(), ErrorCode::MalformedFrame);
        }
        other => panic!("expected Truncated, got {other:?}"),
    }
    send.finish().unwrap();

    let err = conn.closed().await;
    match err {
        quinn::ConnectionError::ApplicationClosed(c) => {
            assert_eq!(
                ErrorCode::from_varint(c.error_code),
                Some(ErrorCode::ClosedByPeer)
            );
        }
        other => panic!("unexpected close {other:?}"),
    }

    // A client that does not trust our CA: the handshake fails on this side too.
    let incoming = endpoint.accept().await.unwrap();
    assert!(
        incoming.await.is_err(),
        "untrusted client handshake must fail"
    );
}

#[tokio::test]
async fn loopback_frames_limits_and_trust() {
    install_crypto_provider();
    install_crypto_provider(); // idempotent
    let dir = tempfile::tempdir().unwrap();
    let files = ensure_dev_certs(dir.path()).unwrap();
    let server = server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        server_config(&files).unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    assert_ne!(addr.port(), 0);
    let server_task = tokio::spawn(serve(server.clone()));

    let client_test = async {
        let client = client_endpoint(client_config(&files.ca).unwrap(), addr).unwrap();
        let conn = client.connect(addr, SERVER_NAME).unwrap().await.unwrap();

        // 1: three frames, echoed back.
        let msgs: Vec<Msg> = (0..3)
            .map(|i| Msg {
                seq: i,
                text: format!("message {i}"),
                payload: vec![i as u8; 1000 * (i as usize + 1)],
            })
            .collect();
        let (mut send, recv) = conn.open_bi().await.unwrap();
        for m in &msgs {
            write_frame(&mut send, m).await.unwrap();
        }
        send.finish().unwrap();
        let mut reader = FrameReader::new(recv);
        let mut echoed = Vec::new();
        while let Some(m) = reader.next::<Msg>().await.unwrap() {
            echoed.push(m);
        }
        assert_eq!(echoed, msgs);

        // 2: a header announcing FRAME_BYTES_MAX + 1 bytes.
        let (mut send, recv) = conn.open_bi().await.unwrap();
        let mut raw = ((FRAME_BYTES_MAX + 1) as u32).to_be_bytes().to_vec();
        raw.extend_from_slice(&[0u8; 100]);
        send.write_all(&raw).await.unwrap();
        let mut reader = FrameReader::new(recv);
        assert_eq!(
            reader.next::<ErrorCode>().await.unwrap(),
            Some(ErrorCode::FrameTooLarge)
        );
        assert!(reader.next::<ErrorCode>().await.unwrap().is_none());

        // 3: a frame cut short by the end of the stream.
        let (mut send, recv) = conn.open_bi().await.unwrap();
        let frame = encode_frame(&msgs[2]).unwrap();
        send.write_all(&frame[..frame.len() / 2]).await.unwrap();
        send.finish().unwrap();
        let mut reader = FrameReader::new(recv);
        assert_eq!(
            reader.next::<ErrorCode>().await.unwrap(),
            Some(ErrorCode::MalformedFrame)
        );

        conn.close(ErrorCode::ClosedByPeer.varint(), b"bye");
        client.wait_idle().await;

        // A client trusting another CA fails the handshake.
        let other = tempfile::tempdir().unwrap();
        let other_files = ensure_dev_certs(other.path()).unwrap();
        let stranger = client_endpoint(client_config(&other_files.ca).unwrap(), addr).unwrap();
        let res = stranger.connect(addr, SERVER_NAME).unwrap().await;
        assert!(res.is_err(), "handshake with an untrusted CA must fail");
        stranger.wait_idle().await;
    };
    tokio::time::timeout(TEST_TIMEOUT, client_test)
        .await
        .expect("client timed out");
    tokio::time::timeout(TEST_TIMEOUT, server_task)
        .await
        .expect("server timed out")
        .unwrap();
    server.close(ErrorCode::Shutdown.varint(), b"");
}

#[test]
fn dev_certs_are_reused() {
    let dir = tempfile::tempdir().unwrap();
    let sub = dir.path().join("nested/certs");
    let a = ensure_dev_certs(&sub).unwrap();
    let read = |f: &tether_transport::TlsFiles| {
        [&f.ca, &f.cert, &f.key].map(|p| std::fs::read(p).unwrap())
    };
    let before = read(&a);
    let b = ensure_dev_certs(&sub).unwrap();
    assert_eq!(a.ca, b.ca);
    assert_eq!(a.cert, b.cert);
    assert_eq!(a.key, b.key);
    assert_eq!(before, read(&b));
    assert!(
        std::fs::read(sub.join("ca.key"))
            .unwrap()
            .starts_with(b"-----BEGIN")
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        for key in ["ca.key", "server.key"] {
            let mode = std::fs::metadata(sub.join(key))
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(mode, 0o600, "{key}");
        }
    }

    // Losing the server files re-signs a new server certificate with the same CA.
    std::fs::remove_file(&a.cert).unwrap();
    std::fs::remove_file(&a.key).unwrap();
    let c = ensure_dev_certs(&sub).unwrap();
    assert_eq!(std::fs::read(&c.ca).unwrap(), before[0]);
    assert_ne!(std::fs::read(&c.cert).unwrap(), before[1]);
    server_config(&c).unwrap();
}

/// The re-signed server certificate still chains to the original CA.
#[tokio::test]
async fn resigned_server_cert_is_trusted() {
    let dir = tempfile::tempdir().unwrap();
    let files = ensure_dev_certs(dir.path()).unwrap();
    std::fs::remove_file(&files.cert).unwrap();
    let files = ensure_dev_certs(dir.path()).unwrap();
    let ca_pem = std::fs::read(&files.ca).unwrap();
    let server = server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        server_config(&files).unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let srv = server.clone();
    let accept = tokio::spawn(async move {
        let conn = srv.accept().await.unwrap().await.unwrap();
        conn.closed().await;
    });
    let client = client_endpoint(
        tether_transport::client_config_from_pem(&ca_pem).unwrap(),
        addr,
    )
    .unwrap();
    let conn = tokio::time::timeout(TEST_TIMEOUT, client.connect(addr, SERVER_NAME).unwrap())
        .await
        .unwrap()
        .unwrap();
    conn.close(ErrorCode::ClosedByPeer.varint(), b"");
    client.wait_idle().await;
    tokio::time::timeout(TEST_TIMEOUT, accept)
        .await
        .unwrap()
        .unwrap();
}
