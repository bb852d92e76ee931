{{- define "splitfire.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "splitfire.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one component: pass (dict "ctx" $ "component" "router") */}}
{{- define "splitfire.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "splitfire.tag" -}}
{{- .Values.image.tag | default .Chart.AppVersion -}}
{{- end -}}

{{- define "splitfire.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- .Values.serviceAccount.name | default (include "splitfire.fullname" .) -}}
{{- else -}}
{{- .Values.serviceAccount.name | default "default" -}}
{{- end -}}
{{- end -}}

{{- define "splitfire.prefillPort" -}}{{ add .Values.workers.grpcPort 10 }}{{- end -}}
{{- define "splitfire.prefillMetricsPort" -}}{{ add .Values.workers.metricsPort 10 }}{{- end -}}

{{/* The model volume every pod mounts */}}
{{- define "splitfire.modelVolume" -}}
- name: models
{{- if eq .Values.model.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ .Values.model.pvc.claimName | default (printf "%s-models" (include "splitfire.fullname" .)) }}
    readOnly: {{ eq .Values.model.pvc.accessMode "ReadOnlyMany" }}
{{- else if eq .Values.model.source "hostPath" }}
  hostPath:
    path: {{ .Values.model.hostPath.path }}
    type: Directory
{{- else }}
  emptyDir: {}
{{- end }}
- name: tmp
  emptyDir: {}
{{- end -}}

{{- define "splitfire.modelEnv" -}}
{{- include "splitfire.modelEnvFor" (dict "ctx" . "model" .Values.model.name) }}
{{- end -}}

{{/* The model env of one model (a model pool's); pass (dict "ctx" $ "model" <name or path>) */}}
{{- define "splitfire.modelEnvFor" -}}
{{- with .ctx }}
- name: SPLITFIRE_MODEL
  value: {{ $.model | quote }}
- name: SPLITFIRE_HOME
  value: {{ .Values.model.mountPath | quote }}
- name: HOME
  value: /tmp
{{- if .Values.model.hfTokenSecret.name }}
- name: HF_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .Values.model.hfTokenSecret.name }}
      key: {{ .Values.model.hfTokenSecret.key }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Init containers that fetch the models when model.source=fetch; pass (dict "ctx" $ "image" <image>
     "models" (list <name or path> ...)), one container each (default: model.name) */}}
{{- define "splitfire.fetchInit" -}}
{{- if eq .ctx.Values.model.source "fetch" }}
initContainers:
{{- range $i, $m := (.models | default (list .ctx.Values.model.name)) }}
  - name: fetch-model{{ if $i }}-{{ $i }}{{ end }}
    image: {{ $.image }}
    imagePullPolicy: {{ $.ctx.Values.image.pullPolicy }}
    command: ["splitfire", "model", "fetch"]
    env:
      {{- include "splitfire.modelEnvFor" (dict "ctx" $.ctx "model" $m) | nindent 6 }}
    volumeMounts:
      - {name: models, mountPath: {{ $.ctx.Values.model.mountPath }}}
      - {name: tmp, mountPath: /tmp}
    securityContext:
      {{- toYaml $.ctx.Values.workers.securityContext | nindent 6 }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Every model pool of the release: the main one (name "", the chart's model, prefill and decode
     values) and each of modelPools, its prefill/decode values merged over the chart's */}}
{{- define "splitfire.pools" -}}
{{- $pools := list (dict "name" "" "model" .Values.model.name "prefill" .Values.prefill "decode" .Values.decode) }}
{{- range .Values.modelPools }}
{{- $pools = append $pools (dict "name" .name "model" .model
      "prefill" (merge (deepCopy (.prefill | default dict)) (deepCopy $.Values.prefill))
      "decode" (merge (deepCopy (.decode | default dict)) (deepCopy $.Values.decode))) }}
{{- end }}
{{- toJson $pools }}
{{- end -}}

{{- define "splitfire.tracingEnv" -}}
{{- if .Values.tracing.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .Values.tracing.otlpEndpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ .Values.tracing.protocol | quote }}
- name: OTEL_EXPORTER_OTLP_INSECURE
  value: {{ .Values.tracing.insecure | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .Values.tracing.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .Values.tracing.samplerArg | quote }}
{{- end }}
{{- end -}}

{{- define "splitfire.redisURLEnv" -}}
{{- if .Values.redis.enabled }}
- name: REDIS_URL
  value: {{ printf "redis://%s-redis:6379/0" (include "splitfire.fullname" .) | quote }}
{{- else if .Values.redis.external.secretName }}
- name: REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.external.secretName }}
      key: {{ .Values.redis.external.key }}
{{- end }}
{{- end -}}

{{/* A role's tensor-parallel size: its own tensorParallelSize, else workers.tensorParallelSize; pass
     (dict "ctx" $ "v" <the role's values>) */}}
{{- define "splitfire.roleTP" -}}
{{- ternary (int .v.tensorParallelSize) (int .ctx.Values.workers.tensorParallelSize) (gt (int .v.tensorParallelSize) 0) }}
{{- end -}}

{{/* A role's pipeline stages: its own pipelineParallelSize, else workers.pipelineParallelSize (1 when
     unset); same arguments as splitfire.roleTP */}}
{{- define "splitfire.rolePP" -}}
{{- $w := int (default 1 .ctx.Values.workers.pipelineParallelSize) }}
{{- ternary (int (default 0 .v.pipelineParallelSize)) $w (gt (int (default 0 .v.pipelineParallelSize)) 0) }}
{{- end -}}
