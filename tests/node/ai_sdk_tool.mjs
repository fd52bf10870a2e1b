// One tool-using turn of the Vercel AI SDK against the gateway (tests/test_ai_sdk_node.py):
// streamText with a get_weather tool and stopWhen, so the tool's result goes back and the
// model answers. Prints what came of it as one JSON line.
//
//   node ai_sdk_tool.mjs PROVIDER BASE_URL MODEL PROMPT
//
// PROVIDER: openai (the provider's default model, which speaks Responses), openai-chat
// (openai.chat(...), Chat Completions) or anthropic (Messages).
import { createAnthropic } from "@ai-sdk/anthropic";
import { createOpenAI } from "@ai-sdk/openai";
import { stepCountIs, streamText, tool } from "ai";
import { z } from "zod";

const [provider, baseURL, modelId, prompt] = process.argv.slice(2);

function model() {
  if (provider === "anthropic") {
    return createAnthropic({ baseURL, apiKey: "client-key" })(modelId);
  }
  const openai = createOpenAI({ baseURL, apiKey: "client-key" });
  if (provider === "openai-chat") return openai.chat(modelId);
  if (provider === "openai") return openai(modelId);
  throw new Error(`unknown provider ${provider}`);
}

const ran = [];
const result = streamText({
  model: model(),
  prompt,
  tools: {
    get_weather: tool({
      description: "The weather in a city.",
      inputSchema: z.object({ city: z.string() }),
      execute: async ({ city }) => {
        ran.push(city);
        return `sunny in ${city}`;
      },
    }),
  },
  stopWhen: stepCountIs(3),
  maxRetries: 0,
});

const parts = [];
let text = "";
for await (const part of result.fullStream) {
  parts.push(part.type);
  if (part.type === "text-delta") text += part.text;
  if (part.type === "error") throw part.error;
}
const steps = await result.steps;
console.log(
  JSON.stringify({
    ran,
    text,
    parts,
    finishReason: await result.finishReason,
    steps: steps.map((s) => ({
      finishReason: s.finishReason,
      toolCalls: s.toolCalls.map((c) => ({ name: c.toolName, input: c.input })),
      toolResults: s.toolResults.map((r) => r.output),
      text: s.text,
      dropped: s.response?.headers?.["x-aiserve-dropped"] ?? null,
    })),
  }),
);
