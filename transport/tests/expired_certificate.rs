//! Bad input at the TLS layer: a server whose certificate has expired is refused, and the error
//! a client sees says so (the client library passes this text on, once, naming the server).
//! Real QUIC+TLS endpoints on loopback.

use tether_transport::{endpoint, tls};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_server_certificate_is_refused_with_a_clear_error() {
    tls::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let files = tls::ensure_dev_certs(dir.path()).unwrap();
    // A certificate for `localhost` from the same dev CA, expired since yesterday.
    let ca_key = rcgen::KeyPair::from_pem(
        &std::fs::read_to_string(dir.path().join(tls::CA_KEY_FILE)).unwrap(),
    )
    .unwrap();
    let issuer =
        rcgen::Issuer::from_ca_cert_pem(&std::fs::read_to_string(&files.ca).unwrap(), ca_key)
            .unwrap();
    let mut params = rcgen::CertificateParams::new(vec![tls::SERVER_NAME.to_string()]).unwrap();
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(30);
    params.not_after = now - time::Duration::days(1);
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, &issuer).unwrap();
    let expired = tls::TlsFiles {
        ca: files.ca.clone(),
        cert: dir.path().join("expired.pem"),
        key: dir.path().join("expired.key"),
    };
    std::fs::write(&expired.cert, cert.pem()).unwrap();
    std::fs::write(&expired.key, key.serialize_pem()).unwrap();

    let server = endpoint::server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        tls::server_config(&expired).unwrap(),
    )
    .unwrap();
    let addr = server.local_addr().unwrap();
    let accepting = server.clone();
    tokio::spawn(async move {
        while let Some(incoming) = accepting.accept().await {
            let _ = incoming.await;
        }
    });
    let client = endpoint::client_endpoint(tls::client_config(&files.ca).unwrap(), addr).unwrap();
    let err = client
        .connect(addr, tls::SERVER_NAME)
        .unwrap()
        .await
        .expect_err("an expired certificate is refused")
        .to_string();
    assert!(err.contains("expired"), "{err}");
    // The same CA's valid certificate is accepted: only the expiry was wrong.
    let good = endpoint::server_endpoint(
        "127.0.0.1:0".parse().unwrap(),
        tls::server_config(&files).unwrap(),
    )
    .unwrap();
    let good_addr = good.local_addr().unwrap();
    tokio::spawn(async move {
        while let Some(incoming) = good.accept().await {
            if let Ok(conn) = incoming.await {
                conn.closed().await;
            }
        }
    });
    let conn = client
        .connect(good_addr, tls::SERVER_NAME)
        .unwrap()
        .await
        .expect("a valid certificate is accepted");
    conn.close(0u32.into(), b"done");
    server.close(0u32.into(), b"done");
}
