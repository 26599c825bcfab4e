"""HTTP plumbing shared by the gateway and the engine server: client transports, the uvicorn
protocol, client-disconnect watching and the OpenAI error responses of litestar apps."""
